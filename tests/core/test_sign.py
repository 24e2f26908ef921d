"""The sign family: signsgd, signum, efsignsgd (+ its memory), onebit.

Every expected value is computed here with numpy (np.packbits for the wire bytes), never by
calling the code under test.
"""

import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from ranks import run_ranks

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS

METHODS = ("signsgd", "signum", "efsignsgd", "onebit")
EXTRA_BYTES = {"signsgd": 0, "signum": 0, "efsignsgd": 4, "onebit": 8}  # fp32 scale / two means
PAYLOAD_TENSORS = {"signsgd": 1, "signum": 1, "efsignsgd": 2, "onebit": 2}
HEADER_BYTES = 8  # allgather/broadcast size header: one int64 per payload tensor


# -- independent numpy references -------------------------------------------------------


def ref_signs(x):
    return np.where(np.asarray(x) >= 0, 1.0, -1.0)  # zero (and -0.0) -> +1


def ref_packed(x):
    return np.packbits((np.asarray(x).reshape(-1) >= 0).astype(np.uint8), bitorder="little")


def ref_scaled_sign(p):
    p = np.asarray(p, dtype=np.float64)
    return ref_signs(p) * (np.abs(p).sum() / max(p.size, 1))


def ref_onebit(x):
    x = np.asarray(x, dtype=np.float64)
    pos = x >= 0
    mean_pos = x[pos].mean() if pos.any() else 0.0
    mean_neg = x[~pos].mean() if (~pos).any() else 0.0
    return np.where(pos, mean_pos, mean_neg), (mean_neg, mean_pos)


def ref_vote(per_rank_signs):
    return np.sign(np.sum(per_rank_signs, axis=0))  # tie -> 0


def compressor(name, **params):
    return COMPRESSORS.get(name)(**params)


def floats(min_size=0):
    return hnp.arrays(
        np.float32,
        st.integers(min_size, 70),
        elements=st.one_of(st.just(0.0), st.just(-0.0), st.floats(-1e3, 1e3, width=32)),
    )


# -- compress -> decompress against the references --------------------------------------


@settings(max_examples=60, deadline=None)
@given(floats())
def test_signsgd_wire_and_values(x):
    comp = compressor("signsgd")
    payload, ctx = comp.compress(torch.from_numpy(x), "t")
    assert len(payload) == 1 and payload[0].dtype == torch.uint8
    np.testing.assert_array_equal(payload[0].numpy(), ref_packed(x))
    np.testing.assert_array_equal(comp.decompress(payload, ctx).numpy(), ref_signs(x))


@settings(max_examples=60, deadline=None)
@given(floats())
def test_efsignsgd_wire_and_values(x):
    comp = compressor("efsignsgd")
    payload, ctx = comp.compress(torch.from_numpy(x), "t")
    np.testing.assert_array_equal(payload[0].numpy(), ref_packed(x))
    assert payload[1].dtype == torch.float32 and payload[1].numel() == 1
    np.testing.assert_allclose(comp.decompress(payload, ctx).numpy(), ref_scaled_sign(x), rtol=1e-5, atol=1e-30)


@settings(max_examples=60, deadline=None)
@given(floats())
def test_onebit_wire_and_means(x):
    comp = compressor("onebit")
    payload, ctx = comp.compress(torch.from_numpy(x), "t")
    expected, (mean_neg, mean_pos) = ref_onebit(x)
    np.testing.assert_array_equal(payload[0].numpy(), ref_packed(x))
    np.testing.assert_allclose(payload[1].numpy(), [mean_neg, mean_pos], rtol=1e-5, atol=1e-30)
    out = comp.decompress(payload, ctx).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-30)
    # each group's mean is its L2-optimal value, so the tensor's sum is kept
    np.testing.assert_allclose(out.sum(dtype=np.float64), x.sum(dtype=np.float64), rtol=1e-4, atol=1e-3)


def test_exact_hand_values():
    x = torch.tensor([[0.5, -1.5], [0.0, 2.0], [-1.0, 3.0]])  # 6 elements, one zero
    # packed bits, little-endian: +,-,+,+,-,+  -> 0b101101 = 45
    for name in METHODS:
        payload, _ = compressor(name).compress(x, "x")
        assert payload[0].tolist() == [45]
    comp = compressor("efsignsgd")
    out = comp.decompress(*comp.compress(x, "x"))  # ‖x‖₁/6 = 8/6
    assert torch.equal(out, torch.tensor([[1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]]) * (8 / 6))
    comp = compressor("onebit")
    payload, ctx = comp.compress(x, "x")
    assert payload[1].tolist() == [-1.25, 1.375]  # mean(-1.5,-1) ; mean(.5,0,2,3)
    assert torch.equal(comp.decompress(payload, ctx), torch.tensor([[1.375, -1.25], [1.375, 1.375], [-1.25, 1.375]]))


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtype_and_shape_are_kept(name, dtype):
    x = torch.linspace(-2, 3, 21, dtype=dtype).reshape(3, 7)
    comp = compressor(name)
    out = comp.decompress(*comp.compress(x, "x"))
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(torch.sign(out), torch.from_numpy(ref_signs(x.float().numpy())).to(dtype))


@pytest.mark.parametrize("name", METHODS)
def test_empty_and_all_zero(name):
    comp = compressor(name)
    empty = comp.decompress(*comp.compress(torch.empty(0, 3), "e"))
    assert empty.shape == (0, 3)
    payload, ctx = comp.compress(torch.zeros(5), "z")
    expected = {"signsgd": 1.0, "signum": 1.0, "efsignsgd": 0.0, "onebit": 0.0}[name]
    assert torch.equal(comp.decompress(payload, ctx), torch.full((5,), expected))
    # every element travels, even one that decodes to 0 (momentum masking relies on this)
    assert comp.sent_mask(payload, ctx).all() and comp.sent_mask(payload, ctx).shape == (5,)


# -- aggregation -------------------------------------------------------------------------


def test_majority_vote_by_hand():
    comp = compressor("signsgd")
    ranks = [
        torch.tensor([1.0, -1.0, 0.0, -2.0]),
        torch.tensor([-1.0, -1.0, 3.0, 5.0]),
        torch.tensor([2.0, 1.0, -1.0, -3.0]),
    ]
    # signs: [+,-,+,-], [-,-,+,+], [+,+,-,-]; sums [1,-1,1,-1]
    signs = [comp.decompress(*comp.compress(r, "v")) for r in ranks]
    assert torch.equal(comp.aggregate(signs), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    # two ranks: disagreement is a tie -> 0, agreement -> the common sign
    assert torch.equal(comp.aggregate(signs[:2]), torch.tensor([0.0, -1.0, 1.0, 0.0]))
    assert comp.average is False
    assert compressor("signum").average is False
    assert compressor("efsignsgd").average is True and compressor("onebit").average is True


def test_signum_momentum_against_a_loop():
    beta, steps = 0.8, 6
    rng = np.random.default_rng(3)
    grads = rng.standard_normal((steps, 50)).astype(np.float32)
    grace = grace_dgc.build("signum", "none", "allgather", engine="local", momentum=beta)
    m = np.zeros(50)
    for g in grads:
        m = beta * m + (1 - beta) * g.astype(np.float64)
        out = grace.step(torch.from_numpy(g), "w").numpy()
        np.testing.assert_array_equal(out, ref_signs(m))  # one rank: the vote is its sign
        np.testing.assert_allclose(grace.compressor.momentums["w"].numpy(), m, rtol=1e-5, atol=1e-7)


# -- efsignsgd memory --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda n: st.lists(
            st.tuples(
                hnp.arrays(np.float32, n, elements=st.floats(-10, 10, width=32)),
                st.sampled_from([0.01, 0.1, 0.5, 1.0, 3.0]),
            ),
            min_size=1,
            max_size=6,
        )
    )
)
def test_efsignsgd_memory_error_feedback(steps):
    grace = grace_dgc.build("efsignsgd", "efsignsgd", "allgather", engine="local", lr=steps[0][1])
    sent_sum, grad_sum = 0.0, 0.0
    for g, lr in steps:
        grace.memory.lr = lr  # as an LR scheduler hook would
        e = grace.memory.residuals.get("w", torch.zeros(g.size)).numpy().astype(np.float64)
        out = grace.step(torch.from_numpy(g), "w").numpy().astype(np.float64)
        # one step of the paper's loop from the same e: the optimizer's step lr·out is Δ_t
        p = lr * g.astype(np.float64) + e
        delta = ref_scaled_sign(p)
        clear = np.abs(p) > 1e-6 * np.abs(p).max(initial=0)  # a sign at ~0 is rounding's call
        np.testing.assert_allclose((lr * out)[clear], delta[clear], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.abs(lr * out), np.abs(delta), rtol=1e-4, atol=1e-6)
        sent_sum = sent_sum + lr * out
        grad_sum = grad_sum + lr * g.astype(np.float64)
    final_e = grace.memory.residuals["w"].numpy().astype(np.float64)
    np.testing.assert_allclose(sent_sum + final_e, grad_sum, rtol=1e-4, atol=1e-4)


def test_efsignsgd_lr_routing_and_validation():
    grace = grace_dgc.from_params(
        {"compressor": "efsignsgd", "memory": "efsignsgd", "communicator": "allgather", "lr": 0.1, "engine": "local"}
    )
    assert grace.memory.lr == 0.1
    with pytest.raises(GraceConfigError, match="lr"):
        grace_dgc.build("efsignsgd", "efsignsgd", "allgather", engine="local", lr=0)
    with pytest.raises(GraceConfigError, match="momentum"):
        grace_dgc.build("signum", "none", "allgather", engine="local", momentum=1.0)


def test_onebit_with_residual_keeps_all_mass():
    rng = np.random.default_rng(5)
    grace = grace_dgc.build("onebit", "residual", "broadcast", engine="local")
    grads = rng.standard_normal((5, 33)).astype(np.float32)
    sent = sum(grace.step(torch.from_numpy(g), "w").numpy().astype(np.float64) for g in grads)
    np.testing.assert_allclose(sent + grace.memory.residuals["w"].numpy(), grads.sum(0), rtol=1e-5, atol=1e-5)


# -- state ---------------------------------------------------------------------------------


def _continue(grace, grads):
    return [grace.step(g, "w") for g in grads]


@pytest.mark.parametrize("name,memory", [("signum", "none"), ("efsignsgd", "efsignsgd")])
def test_state_dict_round_trip(name, memory):
    grads = [torch.randn(37, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    params = {"lr": 0.3} if memory == "efsignsgd" else {"momentum": 0.7}
    first = grace_dgc.build(name, memory, "allgather", engine="local", **params)
    _continue(first, grads[:3])
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = grace_dgc.build(name, memory, "allgather", engine="local")  # default params
    if memory == "efsignsgd":
        resumed.load_state_dict(state)  # lr is part of the memory's state
        assert resumed.memory.lr == 0.3
    else:
        resumed = grace_dgc.build(name, memory, "allgather", engine="local", momentum=0.7)
        resumed.load_state_dict(state)
    for a, b in zip(_continue(first, grads[3:]), _continue(resumed, grads[3:])):
        assert torch.equal(a, b)
    assert state[("compressor" if name == "signum" else "memory")]


# -- bytes on the wire --------------------------------------------------------------------


@pytest.mark.parametrize("communicator", ["allgather", "broadcast"])
def test_bytes_sent(communicator):
    for name in METHODS:
        for n in (0, 1, 7, 8, 9, 63, 1000, 1001):
            grace = grace_dgc.build(name, "none", communicator, engine="local")
            grace.step(torch.randn(n), "w")
            expected = math.ceil(n / 8) + EXTRA_BYTES[name] + HEADER_BYTES * PAYLOAD_TENSORS[name]
            assert grace.stats()["bytes_sent"] == expected, (name, n)


@pytest.mark.parametrize("name", METHODS)
def test_allreduce_refused_at_build(name):
    with pytest.raises(GraceConfigError, match="cannot be summed"):
        grace_dgc.build(name, "none", "allreduce", engine="local")


# -- 2 and 3 real ranks -------------------------------------------------------------------

CASES = [
    (name, memory, comm, params)
    for name, memory, params in [
        ("signsgd", "none", {}),
        ("signum", "none", {"momentum": 0.6}),
        ("efsignsgd", "efsignsgd", {"lr": 0.2}),
        ("onebit", "residual", {}),
    ]
    for comm in ("allgather", "broadcast")
]
SHAPE, STEPS = (5, 7), 3  # 35 elements: an odd number of bits


def rank_grad(case, rank, step):
    gen = torch.Generator().manual_seed(1000 * case + 10 * rank + step)
    g = torch.randn(SHAPE, generator=gen)
    g.view(-1)[::6] = 0.0  # exact zeros: the zero rule is exercised
    return g


def _rank_main(rank, world, cases):
    results = []
    for i, (name, memory, comm, params) in enumerate(cases):
        grace = grace_dgc.build(name, memory, comm, engine="torch", **params)
        outs = [grace.step(rank_grad(i, rank, s), "w") for s in range(STEPS)]
        results.append((outs, grace.stats()["bytes_sent"]))
    return results


def expected_outputs(case, name, params, world):
    """Each rank's sent values, simulated in numpy, then aggregated as the method says."""
    beta, lr = params.get("momentum"), params.get("lr")
    state = [np.zeros(SHAPE) for _ in range(world)]
    outputs = []
    for step in range(STEPS):
        sent = []
        for rank in range(world):
            g = rank_grad(case, rank, step).numpy().astype(np.float64)
            if name == "signsgd":
                sent.append(ref_signs(g))
            elif name == "signum":
                state[rank] = beta * state[rank] + (1 - beta) * g
                sent.append(ref_signs(state[rank]))
            elif name == "efsignsgd":  # paper units; optimizer units = Δ/lr
                p = lr * g + state[rank]
                delta = ref_scaled_sign(p.reshape(-1)).reshape(SHAPE)
                state[rank] = p - delta
                sent.append(delta / lr)
            else:  # onebit with residual
                p = g + state[rank]
                q = ref_onebit(p.reshape(-1))[0].reshape(SHAPE)
                state[rank] = p - q
                sent.append(q)
        outputs.append(ref_vote(sent) if name in ("signsgd", "signum") else np.mean(sent, axis=0))
    return outputs


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_and_match_reference(world):
    results = run_ranks(_rank_main, world, (CASES,))
    n = SHAPE[0] * SHAPE[1]
    for i, (name, _memory, comm, params) in enumerate(CASES):
        expected = expected_outputs(i, name, params, world)
        for rank in range(world):
            outs, sent_bytes = results[rank][i]
            for step, (out, exp) in enumerate(zip(outs, expected)):
                assert torch.equal(out, results[0][i][0][step]), (name, comm, rank, step)
                if name in ("signsgd", "signum"):
                    np.testing.assert_array_equal(out.numpy(), exp, err_msg=f"{name} {comm}")
                else:
                    np.testing.assert_allclose(out.numpy(), exp, rtol=1e-4, atol=1e-5, err_msg=f"{name} {comm}")
            per_step = math.ceil(n / 8) + EXTRA_BYTES[name] + HEADER_BYTES * PAYLOAD_TENSORS[name]
            assert sent_bytes == STEPS * per_step, (name, comm, rank)
        if name == "signsgd" and world == 2:  # the tie rule was exercised
            assert any((out == 0).any() for out in results[0][i][0])


@pytest.mark.parametrize(
    "values",
    [[1.0, -2.0, 0.5], [3e38, 3e38, 1.0], [-3e38, -3e38], [float("nan"), 1.0], [float("inf"), 2.0], [], [0.0, -0.0]],
)
def test_onebits_mean_without_host_reads_is_the_one_with_them(values):
    """On a GPU onebit's means make no host read (the fp64 sum always runs and a select picks,
    issue 58); the result must be the CPU's (the fp64 sum only where fp32 overflows), bit for
    bit, overflow, NaN, infinity and an empty group included."""
    from grace_dgc.compressors.onebit import _mean

    x = torch.tensor(values, dtype=torch.float32)
    count = torch.tensor(float(len(values)))
    with_reads, without = _mean(x, count, host_reads=True), _mean(x, count, host_reads=False)
    assert with_reads.dtype == without.dtype == torch.float32
    assert torch.equal(with_reads.view(torch.int32), without.view(torch.int32))


@pytest.mark.parametrize("scale", ["mean", "rms"])
@pytest.mark.parametrize(
    "values", [[1.0, -2.0, 0.5], [3e38, -3e38, 1.0], [2e19, 2e19], [float("nan"), 1.0], [float("inf"), 2.0], [0.0]]
)
def test_efsignsgds_scale_without_host_reads_is_the_one_with_them(scale, values):
    """On a GPU efsignsgd's scale makes no host read (the fp64 norm always runs and a select
    picks, issue 58): the CPU's bits (the fp64 norm only where fp32 overflows, as for 3e38's ℓ1
    and 2e19's ℓ2), NaN and infinity included."""
    from grace_dgc.compressors.packed import narrow_or_wide as _narrow_or_wide

    x = torch.tensor(values)
    norm = {"mean": lambda d: x.abs().sum(dtype=d) / len(values), "rms": lambda d: x.norm(dtype=d) / len(values) ** 0.5}
    with_reads = _narrow_or_wide(norm[scale], x.device, host_reads=True)
    without = _narrow_or_wide(norm[scale], x.device, host_reads=False)
    assert with_reads.dtype == without.dtype == torch.float32
    assert torch.equal(with_reads.view(torch.int32), without.view(torch.int32))
    if values[0] in (3e38, 2e19) and (scale == "rms" or values[0] == 3e38):  # fp32 overflowed: the fp64 norm
        assert math.isfinite(with_reads) and with_reads == norm[scale](torch.float64).float()
