"""DeMo: the ``demo`` compressor (chunked DCT, top-k per chunk, sign of the senders' mean) and
the ``demo`` memory (decoupled momentum).

Every expected value is computed here with numpy/scipy (scipy.fft's orthonormal DCT-II, a
top-k by argsort, the chunk choice by a scan of divisors), never by calling the code under test.
"""

import logging
import pickle

import numpy as np
import pytest
import scipy.fft
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from ranks import run_ranks

import grace_dgc
from grace_dgc.compressors.demo import DemoCompressor, chunk_of, dct_basis
from grace_dgc.errors import GraceConfigError
from grace_dgc.memories.demo import DemoMemory
from grace_dgc.registry import COMMUNICATORS

# -- independent numpy references -------------------------------------------------------


def ref_chunk(size, target):
    """The reference's ``_get_smaller_split``: the largest divisor of size not above target."""
    return max([d for d in range(1, size + 1) if size % d == 0 and d <= target], default=1)


def ref_blocks(x, target):
    """x as a (rows, cols) matrix (a vector: 1 × n; ≥3-D: shape[0] × rest) cut into blocks:
    array (row blocks, column blocks, c1, c2)."""
    rows = x.shape[0] if x.ndim >= 2 else 1
    cols = x.size // rows if rows else 0
    c1, c2 = ref_chunk(rows, target), ref_chunk(cols, target)
    return x.reshape(rows // c1, c1, cols // c2, c2).transpose(0, 2, 1, 3)


def ref_dct(x, target):
    """Coefficients (blocks, c1·c2) of the blockwise orthonormal 2-D DCT-II."""
    blocks = ref_blocks(np.asarray(x, dtype=np.float64), target)
    coeffs = scipy.fft.dctn(blocks, type=2, norm="ortho", axes=(2, 3)) if blocks.size else blocks
    return coeffs.reshape(-1, blocks.shape[2] * blocks.shape[3])


def ref_idct(coeffs, shape, target):
    template = ref_blocks(np.zeros(shape), target)
    blocks = coeffs.reshape(template.shape)
    x = scipy.fft.idctn(blocks, type=2, norm="ortho", axes=(2, 3)) if blocks.size else blocks
    return x.transpose(0, 2, 1, 3).reshape(shape)


def ref_top(coeffs, topk):
    """(kept coefficients, bool mask of the sent ones): the min(topk, c1·c2) largest |.| per row."""
    k = min(topk, coeffs.shape[1])
    order = np.argsort(-np.abs(coeffs), axis=1, kind="stable")[:, :k]
    mask = np.zeros(coeffs.shape, dtype=bool)
    np.put_along_axis(mask, order, True, axis=1)
    return np.where(mask, coeffs, 0.0), mask


def ref_extract(m, chunk, topk):
    """q = IDCT(top-k per chunk(DCT(m))), with the kept coefficients and their mask."""
    kept, mask = ref_top(ref_dct(m, chunk), topk)
    return ref_idct(kept, m.shape, chunk), kept, mask


def ref_aggregate(kepts, masks, shape, chunk, sign):
    """Per coefficient the mean over the ranks that sent it (0 if none), IDCT, sign."""
    count = np.sum(masks, axis=0)
    mean = np.sum(kepts, axis=0) / np.maximum(count, 1)
    u = ref_idct(mean, shape, chunk)
    return (np.sign(u) if sign else u), u


def dense_payload(payload, ctx):
    """The sent coefficients as a (blocks, c1·c2) array, and the mask of the sent positions."""
    values, indices = (t.numpy() for t in payload)
    coeffs = np.zeros((ctx.blocks, ctx.c1 * ctx.c2))
    mask = np.zeros(coeffs.shape, dtype=bool)
    rows = np.repeat(np.arange(ctx.blocks), ctx.k)
    coeffs[rows, indices.astype(np.int64)] = values
    mask[rows, indices.astype(np.int64)] = True
    return coeffs, mask


SHAPES = [(64,), (100,), (127,), (1000,), (5,), (64, 64), (100, 130), (96, 200), (7, 5), (3, 4, 5), (1, 9)]


def randn(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- (a) the transform ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 50, 64])
def test_dct_basis_is_orthonormal_and_is_scipys_dct_ii(n):
    basis = dct_basis(n, torch.float64, torch.device("cpu")).numpy()
    np.testing.assert_allclose(basis @ basis.T, np.eye(n), atol=1e-13)
    np.testing.assert_allclose(basis, scipy.fft.dct(np.eye(n), type=2, norm="ortho", axis=0), atol=1e-13)


@pytest.mark.parametrize(
    "size, target, expected",
    [(100, 64, 50), (127, 64, 1), (5, 64, 5), (4096, 64, 64), (96, 64, 48), (1000, 64, 50), (64, 64, 64), (1, 64, 1)],
)
def test_chunk_is_the_largest_divisor_not_above_the_target(size, target, expected):
    assert chunk_of(size, target) == expected == ref_chunk(size, target)


def test_chunk_choice_against_the_scan_of_divisors():
    for target in (1, 5, 16, 64):
        for size in range(1, 300):
            assert chunk_of(size, target) == ref_chunk(size, target), (size, target)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [64, 16, 5])
def test_chunked_transform_equals_scipy(shape, chunk):
    comp = DemoCompressor(chunk=chunk, topk=1)
    x = randn(shape, 1)
    ctx = comp.layout(x)
    coeffs = comp.dct(x, ctx)
    np.testing.assert_allclose(coeffs.numpy(), ref_dct(x.numpy(), chunk), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(comp.idct(coeffs, ctx).numpy(), x.numpy(), rtol=1e-12, atol=1e-12)
    x32 = x.float()  # fp32 tensors are transformed in fp32
    np.testing.assert_allclose(comp.dct(x32, ctx).numpy(), ref_dct(x.numpy(), chunk), rtol=1e-5, atol=1e-5)


# -- (b) compress / decompress against the whole algorithm ----------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk, topk", [(64, 32), (16, 3), (8, 1), (4, 16)])
def test_compress_decompress_match_the_reference(shape, chunk, topk):
    comp = DemoCompressor(chunk=chunk, topk=topk)
    x = randn(shape, 2)
    payload, ctx = comp.compress(x, "w")
    q, kept, mask = ref_extract(x.numpy(), chunk, topk)
    assert payload[0].dtype == torch.float64 and payload[1].dtype == torch.int32
    assert payload[0].shape == payload[1].shape == (mask.sum(),)
    sent, sent_mask = dense_payload(payload, ctx)
    np.testing.assert_array_equal(sent_mask, mask)  # exactly the reference's positions
    np.testing.assert_allclose(sent, kept, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(comp.decompress(payload, ctx).numpy(), q, rtol=1e-12, atol=1e-12)
    assert "rank" not in repr(ctx)


@pytest.mark.parametrize("shape", [(1000,), (100, 130), (3, 4, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_inputs_keep_their_dtype(shape, dtype):
    comp = DemoCompressor(chunk=16, topk=4)
    x = randn(shape, 3, dtype)
    payload, ctx = comp.compress(x, "w")
    q = comp.decompress(payload, ctx)
    assert payload[0].dtype == dtype and q.dtype == dtype and q.shape == x.shape
    expected, _, _ = ref_extract(x.double().numpy(), 16, 4)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    np.testing.assert_allclose(q.double().numpy(), expected, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), ()])
def test_empty_and_scalar_tensors(shape):
    comp = DemoCompressor()
    x = randn(shape, 4)
    payload, ctx = comp.compress(x, "w")
    assert payload[0].numel() == x.numel()
    assert torch.equal(comp.decompress(payload, ctx), x)  # all sent (k = 1 of a 1-chunk, or nothing)
    assert comp.decompress_aggregate([payload, payload], ctx).shape == x.shape


def test_bytes_on_the_wire():
    grace = grace_dgc.build("demo", "demo", "allgather", engine="local", chunk=16, topk=3)
    grace.step(torch.randn(100, 130), "w")  # blocks of 10 × 13: 10 · 10 blocks, 3 each
    assert grace.stats()["bytes_sent"] == 100 * 3 * (4 + 4) + 2 * 8  # values, int32 indices, headers


def test_aggregate_of_decoded_tensors_is_the_senders_mean_when_every_rank_sends_everything():
    """With topk = c₁c₂ every rank sends every coefficient: the senders' mean is the mean of
    the decoded tensors, which is what ``aggregate`` computes from them."""
    for sign in (False, True):
        comp = DemoCompressor(chunk=4, topk=16, sign=sign)
        ranks = [randn((8, 12), 40 + r) for r in range(3)]
        payloads, ctxs = zip(*(comp.compress(x, "w") for x in ranks))
        via_payloads = comp.decompress_aggregate(list(payloads), ctxs[0])
        via_tensors = comp.aggregate([comp.decompress(p, ctxs[0]) for p in payloads])
        expected = np.mean([x.numpy() for x in ranks], axis=0)
        np.testing.assert_allclose(via_payloads.numpy(), np.sign(expected) if sign else expected, atol=1e-12)
        np.testing.assert_allclose(via_tensors.numpy(), via_payloads.numpy(), atol=1e-12)


# -- (c) the memory against a loop ----------------------------------------------------------


@pytest.mark.parametrize("beta", [0.999, 0.9, 0.0])
@pytest.mark.parametrize("shape, chunk, topk", [((100, 130), 16, 3), ((300,), 64, 8), ((7, 5), 4, 2)])
def test_memory_against_a_reference_loop(beta, shape, chunk, topk):
    grace = grace_dgc.build("demo", "demo", "allgather", engine="local", beta=beta, chunk=chunk, topk=topk, sign=False)
    m = np.zeros(shape)
    for step in range(6):
        g = randn(shape, 10 + step)
        m = beta * m + g.numpy()
        q, _, _ = ref_extract(m, chunk, topk)
        m = m - q
        out = grace.step(g, "w")  # one rank: the senders' mean is q itself
        np.testing.assert_allclose(out.numpy(), q, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(grace.memory.residuals["w"].numpy(), m, rtol=1e-10, atol=1e-10)


def test_memory_default_and_one_rank_sign():
    assert DemoMemory().beta == 0.999 and DemoMemory().gamma == 1.0
    grace = grace_dgc.build("demo", "demo", "allgather", engine="local", chunk=8, topk=2)
    g = randn((40, 24), 20)
    q, _, _ = ref_extract(g.numpy(), 8, 2)
    np.testing.assert_array_equal(grace.step(g, "w").numpy(), np.sign(q))


def test_an_optimizer_momentum_is_warned_about(caplog):
    model = torch.nn.Linear(4, 3)
    grace = grace_dgc.build("demo", "demo", "allgather", engine="local")
    with caplog.at_level(logging.WARNING, logger="grace_dgc"):
        grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), grace, model.named_parameters()
        )
    assert "plain SGD (momentum=0)" in caplog.text
    caplog.clear()
    grace = grace_dgc.build("demo", "demo", "allgather", engine="local")  # one Grace per way in (issue 55)
    with caplog.at_level(logging.WARNING, logger="grace_dgc"):
        grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters())
    assert "momentum" not in caplog.text


# -- (d) nothing is lost -------------------------------------------------------------------


@st.composite
def cases(draw):
    """Mostly dimensions with divisors and k below a chunk's size, so something is kept."""
    ndim = draw(st.integers(1, 2))
    dims = st.one_of(st.sampled_from([12, 16, 24, 30, 36, 40]), st.integers(1, 40))
    shape = tuple(draw(st.lists(dims, min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    elements = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    first = draw(hnp.arrays(dtype, shape, elements=elements))
    second = draw(hnp.arrays(dtype, shape, elements=elements))
    chunk = draw(st.integers(1, 12))
    topk = draw(st.one_of(st.integers(1, max(1, chunk // 2)), st.integers(1, chunk * chunk)))
    return first, second, chunk, topk, draw(st.floats(0, 0.999))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_sent_plus_kept_is_the_decayed_momentum_plus_the_gradient(case):
    first, second, chunk, topk, beta = case
    comp, memory = DemoCompressor(chunk=chunk, topk=topk), DemoMemory(beta=beta)
    for g in (first, second):
        m_prev = memory.residuals["w"].double().numpy().copy() if "w" in memory.residuals else np.zeros(g.shape)
        p = memory.compensate(torch.from_numpy(g.copy()), "w")
        payload, ctx = comp.compress(p, "w")
        sent = comp.decompress(payload, ctx).double().numpy()
        memory.update(p, "w", comp, payload, ctx)
        kept = memory.residuals["w"].double().numpy()
        expected = beta * m_prev + g.astype(np.float64)
        scale = 1 + np.abs(expected).max() + np.abs(sent).max()
        tol = 1e-12 if g.dtype == np.float64 else 1e-6
        np.testing.assert_allclose(sent + kept, expected, rtol=0, atol=tol * scale)


# -- (e) 2 and 3 real ranks ----------------------------------------------------------------

MULTI_SHAPES = [(100,), (48, 40), (7, 5)]
MULTI_STEPS = 4
MULTI_CASES = [
    ("allgather", {}, torch.float64),
    ("broadcast", {"chunk": 16, "topk": 3, "beta": 0.9}, torch.float64),
    ("allgather", {"chunk": 8, "topk": 2, "beta": 0.5, "sign": False}, torch.float64),
    ("allgather", {"chunk": 16, "topk": 5, "sign": False}, torch.float32),
]


def rank_grad(case, rank, step, tensor, dtype):
    return randn(MULTI_SHAPES[tensor], 100_000 * case + 1000 * rank + 10 * step + tensor, dtype)


def _rank_job(rank, world, cases):
    results = []
    names = [f"t{i}" for i in range(len(MULTI_SHAPES))]
    for i, (comm, params, dtype) in enumerate(cases):
        grace = grace_dgc.build("demo", "demo", comm, engine="torch", **params)
        outs = []
        for step in range(MULTI_STEPS):
            grads = [rank_grad(i, rank, step, t, dtype) for t in range(len(MULTI_SHAPES))]
            outs.append(grace.step_group_async(grads, names).result())
        results.append(outs)
    return results


def expected_outputs(case, params, world, dtype):
    chunk, topk = params.get("chunk", 64), params.get("topk", 32)
    beta, sign = params.get("beta", 0.999), params.get("sign", True)
    momenta = {(r, s): np.zeros(s) for r in range(world) for s in MULTI_SHAPES}
    outputs = []
    for step in range(MULTI_STEPS):
        per_tensor = []
        for t, shape in enumerate(MULTI_SHAPES):
            kepts, masks = [], []
            for rank in range(world):
                g = rank_grad(case, rank, step, t, dtype).double().numpy()
                m = beta * momenta[rank, shape] + g
                q, kept, mask = ref_extract(m, chunk, topk)
                momenta[rank, shape] = m - q
                kepts.append(kept)
                masks.append(mask)
            per_tensor.append(ref_aggregate(kepts, masks, shape, chunk, sign))
        outputs.append(per_tensor)
    return outputs


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_bitwise_and_match_a_one_process_reference(world):
    results = run_ranks(_rank_job, world, (MULTI_CASES,))
    for i, (comm, params, dtype) in enumerate(MULTI_CASES):
        expected = expected_outputs(i, params, world, dtype)
        for step in range(MULTI_STEPS):
            for t, shape in enumerate(MULTI_SHAPES):
                out = results[0][i][step][t]
                for rank in range(1, world):
                    assert torch.equal(results[rank][i][step][t], out), (comm, params, rank, step, shape)
                assert out.dtype == dtype and out.shape == shape
                result, u = expected[step][t]
                if params.get("sign", True):
                    clear = np.abs(u) > 1e-9  # away from 0, the sign cannot depend on rounding
                    assert clear.mean() > 0.99
                    np.testing.assert_array_equal(out.numpy()[clear], result[clear], err_msg=f"{comm} {step}")
                else:
                    tol = 1e-10 if dtype == torch.float64 else 1e-4
                    np.testing.assert_allclose(out.double().numpy(), result, rtol=tol, atol=tol)


# -- (f) resume --------------------------------------------------------------------------


def _steps(grace, grads):
    return [grace.step_group_async([g.clone() for g in pair], ["w", "b"]).result() for pair in grads]


def test_state_dict_resumes_bit_for_bit():
    params = {"chunk": 16, "topk": 3, "beta": 0.9}
    grads = [(randn((48, 40), 30 + s, torch.float32), randn((100,), 60 + s, torch.float32)) for s in range(5)]
    uninterrupted = grace_dgc.build("demo", "demo", "allgather", engine="local", **params)
    expected = _steps(uninterrupted, grads)
    first = grace_dgc.build("demo", "demo", "allgather", engine="local", **params)
    _steps(first, grads[:2])
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert set(state["memory"]["residuals"]) == {"w", "b"}
    resumed = grace_dgc.build("demo", "demo", "allgather", engine="local", **params)
    resumed.load_state_dict(state)
    for got, want in zip(_steps(resumed, grads[2:]), expected[2:]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    other = grace_dgc.build("demo", "demo", "allgather", engine="local", **dict(params, beta=0.5))
    with pytest.raises(GraceConfigError, match="beta"):
        other.load_state_dict(state)


# -- (g), (h) configuration ----------------------------------------------------------------


@pytest.mark.parametrize(
    "params, named",
    [
        ({"chunk": 0}, "chunk"),
        ({"chunk": 2.5}, "chunk"),
        ({"chunk": True}, "chunk"),
        ({"topk": 0}, "topk"),
        ({"topk": 1.5}, "topk"),
        ({"chunk": 8, "topk": 65}, "topk"),
        ({"sign": "yes"}, "sign"),
        ({"sign": 1}, "sign"),
        ({"beta": 1.0}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"beta": float("nan")}, "beta"),
    ],
)
def test_bad_parameters_name_the_parameter(params, named):
    with pytest.raises(GraceConfigError, match=rf"^{named}="):
        grace_dgc.build("demo", "demo", "allgather", engine="local", **params)


def test_topk_may_fill_a_whole_block():
    assert DemoCompressor(chunk=8, topk=64).topk == 64


def test_allreduce_is_refused_at_build():
    with pytest.raises(GraceConfigError, match="cannot carry compressor 'demo'.*cannot be summed.*allgather"):
        grace_dgc.build("demo", "demo", "allreduce", engine="local")


def test_which_communicators_carry_it():
    comp = DemoCompressor()
    assert not comp.summable and not comp.sparse and not comp.chunkable and not comp.average
    assert {"allgather", "broadcast"} <= {c for c in COMMUNICATORS.names() if COMMUNICATORS.get(c).fits(comp)}
    for name in ("allreduce", "sparse_allreduce", "reduce_scatter"):
        assert not COMMUNICATORS.get(name).fits(comp), name
