"""none, fp16, bf16, topk, randomk, threshold and the residual memory, on one process,
against references written here."""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import grace_dgc

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)


def make(compressor, memory="none", communicator="allgather", **params):
    return grace_dgc.build(compressor, memory, communicator, engine="local", **params)


def roundtrip(comp, tensor, name="t"):
    payload, ctx = comp.compress(tensor, name)
    return payload, comp.decompress(payload, ctx)


def test_none_fp16_bf16_values():
    x = torch.tensor([1.0, -2.5, 3.14159265, 1e-8, 70000.0])
    _, out = roundtrip(make("none").compressor, x)
    assert torch.equal(out, x)
    payload, out = roundtrip(make("fp16").compressor, x)
    assert payload[0].dtype == torch.float16
    with np.errstate(over="ignore"):
        expected = np.array([1.0, -2.5, 3.14159265, 1e-8, 70000.0], dtype=np.float32).astype(np.float16)
    assert np.array_equal(out.numpy(), expected.astype(np.float32))  # 70000 → inf, as IEEE half
    payload, out = roundtrip(make("bf16").compressor, x)
    assert payload[0].dtype == torch.bfloat16
    bits = x.numpy().view(np.uint32)
    # bfloat16 = fp32 rounded to nearest-even on the top 16 bits
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    assert np.array_equal(out.numpy(), rounded)


@settings(max_examples=60, deadline=None)
@given(
    arrays(np.float32, shapes, elements=finite),
    st.sampled_from(["none", "fp16", "bf16", "topk", "randomk", "threshold"]),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_compress_decompress_keeps_shape_and_dtype(values, name, dtype):
    tensor = torch.from_numpy(values).to(dtype)
    _, out = roundtrip(make(name).compressor, tensor)
    assert out.shape == tensor.shape and out.dtype == tensor.dtype


@settings(max_examples=80, deadline=None)
@given(arrays(np.float32, st.integers(1, 300), elements=finite, unique=True), st.floats(0.001, 1.0))
def test_topk_returns_exactly_the_k_largest_magnitudes(values, ratio):
    values = np.abs(values) * np.where(np.arange(len(values)) % 2, -1, 1).astype(np.float32)
    assume(len(np.unique(np.abs(values))) == len(values))  # no ties in magnitude
    tensor = torch.from_numpy(values)
    comp = make("topk", compress_ratio=ratio).compressor
    (sent, indices), out = roundtrip(comp, tensor)
    k = max(1, int(len(values) * ratio))
    assert indices.dtype == torch.int32 and len(indices) == k
    expected_idx = np.argsort(-np.abs(values), kind="stable")[:k]
    assert set(indices.tolist()) == set(expected_idx.tolist())
    assert torch.equal(sent, tensor[indices.long()])
    dense = np.zeros_like(values)
    dense[expected_idx] = values[expected_idx]
    assert np.array_equal(out.numpy(), dense)


def test_threshold_keeps_exactly_the_large_entries():
    x = torch.tensor([[0.5, -0.2], [-0.7, 0.3]])
    (values, indices), out = roundtrip(make("threshold", threshold=0.3).compressor, x)
    assert indices.tolist() == [0, 2, 3] and values.tolist() == pytest.approx([0.5, -0.7, 0.3])
    assert torch.equal(out, torch.tensor([[0.5, 0.0], [-0.7, 0.3]]))
    (values, indices), out = roundtrip(make("threshold", threshold=1.0).compressor, x)
    assert values.numel() == 0 and torch.equal(out, torch.zeros(2, 2))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2000), st.floats(0.001, 1.0), st.integers(0, 2**31), st.integers(0, 5))
def test_randomk_ranks_draw_identical_indices(numel, ratio, seed, steps):
    """Two instances (two ranks) with the same seed pick the same indices at every step,
    different steps pick afresh, and the global RNG is untouched."""
    ranks = [make("randomk", compress_ratio=ratio, seed=seed).compressor for _ in range(2)]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    chosen, data = [], torch.Generator().manual_seed(seed)
    for _step in range(steps + 1):
        a = ranks[0].compress(torch.randn(numel, generator=data), "w")[1][0]
        b = ranks[1].compress(torch.zeros(numel), "w")[1][0]
        assert torch.equal(a, b)
        assert len(a) == max(1, int(numel * ratio)) and len(set(a.tolist())) == len(a)
        chosen.append(a)
    assert torch.equal(torch.get_rng_state(), before)  # compressing drew nothing from the global RNG
    k = max(1, int(numel * ratio))
    if steps and math.comb(numel, k) > 10**6:  # two draws alike by chance: 1 / C(n, k)
        assert not all(torch.equal(chosen[0], c) for c in chosen[1:])


def test_randomk_rng_untouched_and_values_at_indices():
    comp = make("randomk", compress_ratio=0.25, seed=3, communicator="allreduce").compressor
    state = torch.get_rng_state()
    x = torch.arange(16.0)
    payload, out = roundtrip(comp, x)
    assert torch.equal(torch.get_rng_state(), state)
    nonzero = out.nonzero().reshape(-1)
    assert len(payload[0]) == 4 and torch.equal(out[nonzero], x[nonzero])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(arrays(np.float32, 17, elements=finite), min_size=1, max_size=12),
    st.sampled_from(
        [
            ("topk", {"compress_ratio": 0.1}),
            ("threshold", {"threshold": 50.0}),
            ("randomk", {"compress_ratio": 0.2}),
            ("fp16", {}),
            ("bf16", {}),
        ]
    ),
)
def test_error_feedback_conserves_gradient_mass(grads, method):
    """Σ transmitted + final residual = Σ gradients (β = γ = 1)."""
    name, params = method
    grace = make(name, "residual", **params)
    sent = torch.zeros(17, dtype=torch.float64)
    for g in grads:
        sent += grace.step(torch.from_numpy(g), "w").double()
    total = torch.from_numpy(np.sum(np.stack(grads).astype(np.float64), axis=0))
    residual = grace.memory.residuals["w"].double()
    scale = max(1.0, float(np.abs(np.stack(grads)).sum()))
    assert torch.allclose(sent + residual, total, rtol=0, atol=1e-5 * scale)


def test_residual_beta_gamma_follow_the_formula():
    grace = make("topk", "residual", compress_ratio=0.5, beta=0.5, gamma=2.0)
    g1, g2 = torch.tensor([4.0, 1.0, -3.0, 0.5]), torch.tensor([1.0, 1.0, 1.0, 1.0])
    out1 = grace.step(g1, "w")  # p = 2 g1 = [8, 2, -6, 1]; send 8, -6
    assert out1.tolist() == [8.0, 0.0, -6.0, 0.0]
    assert grace.memory.residuals["w"].tolist() == [0.0, 2.0, 0.0, 1.0]
    out2 = grace.step(g2, "w")  # p = 0.5 e + 2 g2 = [2, 3, 2, 2.5]
    assert out2.tolist() == [0.0, 3.0, 0.0, 2.5]


def test_stats_count_bytes_and_time():
    grace = make("topk", compress_ratio=0.25)
    for _ in range(3):
        grace.step(torch.randn(100), "a")
        grace.step(torch.randn(40), "b")
    s = grace.stats()
    # per step: header (2 × int64) + values (25 fp32) + indices (25 int32); and 10 + 10 for b
    assert s["steps"] == 3 and s["tensors"] == 6
    assert s["bytes_sent"] == 3 * ((16 + 25 * 8) + (16 + 10 * 8))
    assert s["dense_bytes"] == 3 * 140 * 4
    assert s["compression_ratio"] == pytest.approx(s["bytes_sent"] / s["dense_bytes"])
    assert all(s[k + "_seconds"] > 0 for k in ("compress", "communicate", "decompress"))
    grace.reset_stats()
    assert grace.stats()["bytes_sent"] == 0 and grace.stats()["steps"] == 0


def test_allreduce_bytes_are_the_payload():
    grace = grace_dgc.build("fp16", engine="local")
    grace.step(torch.randn(1000), "w")
    assert grace.stats()["bytes_sent"] == 2000 and grace.stats()["compression_ratio"] == 0.5


def test_state_dict_round_trip_resumes_exactly():
    a = make("randomk", "residual", compress_ratio=0.3, seed=5)
    xs = [torch.randn(50) for _ in range(4)]
    for x in xs[:2]:
        a.step(x, "w")
    b = make("randomk", "residual", compress_ratio=0.3, seed=5)
    b.load_state_dict(a.state_dict())
    for x in xs[2:]:
        assert torch.equal(a.step(x, "w"), b.step(x, "w"))


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "randomk", "topk", "threshold"])
def test_sent_mask_is_the_exact_sent_set_even_for_zeros(name):
    """Memories learn what was sent from sent_mask; a sent exact zero counts as sent."""
    x = torch.tensor([0.0, 1e-30, 0.0, 5.0, -4.0, 0.0, 3.0, 0.0])
    comp = make(
        name,
        **(
            {"compress_ratio": 0.5}
            if name in ("topk", "randomk")
            else {"threshold": 0.0}
            if name == "threshold"
            else {}
        ),
    ).compressor
    payload, ctx = comp.compress(x, "w")
    mask = comp.sent_mask(payload, ctx)
    if name == "randomk":
        expected = torch.zeros(8, dtype=torch.bool)
        expected[ctx[0]] = True
    elif name == "topk":
        expected = torch.tensor([False, True, False, True, True, False, True, False])  # k = 4
    else:
        expected = torch.ones(8, dtype=torch.bool)  # dense casts and threshold 0 send all
    assert torch.equal(mask, expected)


@pytest.mark.parametrize(
    "name, params",
    [
        ("topk", {"compress_ratio": 0.4}),
        ("threshold", {"threshold": 0.5}),
        ("dgc", {"compress_ratio": 0.4, "min_compress_size": 1}),
        ("dgc", {"compress_ratio": 0.4}),
    ],
)
def test_decompress_aggregate_equals_the_sum_of_decompressed(name, params):
    """The sparse fast path (one scatter-add over all ranks) equals decompress-then-sum,
    including indices several ranks sent."""
    comp = make(name, **params).compressor
    gen = torch.Generator().manual_seed(0)
    ranks = [torch.randn(6, 5, generator=gen) for _ in range(3)]
    ranks[1][0, 0] = ranks[2][0, 0] = 10.0  # an index all send
    payloads, ctxs = zip(*(comp.compress(x, "w") for x in ranks))
    expected = sum(comp.decompress(p, ctxs[0]) for p in payloads)
    assert torch.allclose(comp.decompress_aggregate(list(payloads), ctxs[0]), expected, atol=1e-6)
