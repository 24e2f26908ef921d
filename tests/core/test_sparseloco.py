"""SparseLoCo (issue 43, item 2) and its parts, against references written here: chunk-wise
top-k with chunk-local offsets, the 2-bit statistical quantizer, FP4 E3M0 (Streaming DiLoCo's
4 bits), their chain's exact bytes and error feedback, and the schedule's arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from ranks import run_ranks
from test_distributed import batches, make_model

import grace_dgc
from grace_dgc import schedules
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS


def reference_chunk_topk(x: torch.Tensor, chunk: int, k: int) -> list[int]:
    """Global positions kept: per chunk of ``chunk`` elements, its k (⌈k·r/chunk⌉ for a last
    partial chunk of r) largest magnitudes, by a Python sort."""
    flat = x.reshape(-1).tolist()
    kept = []
    for start in range(0, len(flat), chunk):
        part = flat[start : start + chunk]
        keep = k if len(part) == chunk else math.ceil(k * len(part) / chunk)
        kept += sorted(start + j for j in sorted(range(len(part)), key=lambda j: -abs(part[j]))[:keep])
    return kept


def reference_statq(x: torch.Tensor, bits: int, range_sigmas: float) -> tuple[list[int], torch.Tensor]:
    """SparseLoCo's statistical quantizer written out: codes, and the decoded values."""
    v = x.reshape(-1).double()
    levels, n = 2**bits, v.numel()
    mean = v.mean()
    c = v - mean
    sigma = float(c.norm()) / math.sqrt(n - 1) if n > 1 else 0.0
    scale = range_sigmas * sigma / levels or 1.0
    codes = [min(max(round(float(ci) / scale + levels // 2), 0), levels - 1) for ci in c]
    table = [0.0] * levels
    for j in range(levels):
        members = [float(ci) for ci, q in zip(c, codes) if q == j]
        table[j] = sum(members) / len(members) if members else 0.0
    return codes, torch.tensor([table[q] + float(mean) for q in codes])


def reference_statq_float64(x: torch.Tensor, bits: int, range_sigmas: float) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_statq in whole-tensor float64 ops, for a tensor too long for its Python loops."""
    v = x.reshape(-1).double()
    levels, n = 2**bits, v.numel()
    c = v - v.mean()
    scale = range_sigmas * float(c.norm()) / math.sqrt(n - 1) / levels or 1.0
    codes = (c / scale + levels // 2).round().clamp(0, levels - 1).long()
    counts = torch.bincount(codes, minlength=levels)
    table = torch.bincount(codes, weights=c, minlength=levels) / counts.clamp(min=1)
    return codes, table[codes] + v.mean()


def reference_fp4(x: torch.Tensor) -> torch.Tensor:
    """The nearest of the 15 E3M0 values (0 and ±s·2^−6 … ±s) to each element, by search,
    under s = the smallest power of two ≥ max |x|."""
    s = 2.0 ** math.ceil(math.log2(float(x.abs().max()))) if float(x.abs().max()) > 0 else 1.0
    values = [0.0] + [sign * s * 2.0**-e for e in range(7) for sign in (1, -1)]
    return torch.tensor([min(values, key=lambda v: (abs(xi - v), -abs(v))) for xi in x.reshape(-1).tolist()])


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 10_000), st.integers(1, 300), st.sampled_from([(8, 1), (8, 3), (16, 16), (64, 5), (96, 2), (256, 3)])
)
def test_chunk_topk_keeps_k_per_chunk_and_sends_offsets_in_log2_chunk_bits(seed, n, chunk_k):
    chunk, k = chunk_k
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    comp = COMPRESSORS.get("chunk_topk")(chunk=chunk, k=k)
    payload, ctx = comp.compress(x, "w")
    kept = reference_chunk_topk(x, chunk, k)
    expected = torch.zeros(n)
    expected[kept] = x[kept]
    assert torch.equal(comp.decompress(payload, ctx), expected)
    bits = max(1, (chunk - 1).bit_length())
    assert [t.numel() * t.element_size() for t in payload] == [4 * len(kept), math.ceil(len(kept) * bits / 8)]
    residual = comp.subtract_sent_(x.clone(), payload, ctx)
    assert torch.equal(residual + expected, x) and torch.equal(comp.sent_mask(payload, ctx), expected != 0)


@pytest.mark.parametrize(("chunk", "k"), [(4096, 64), (4096, 1), (1000, 7), (65536, 64)])
def test_chunk_topks_two_rounds_keep_a_top_k_of_every_chunk(chunk, k):
    """Long chunks select in two rounds (the k groups with the largest peaks, then the top k of
    their members): the offsets are one torch.topk per chunk's, and where magnitudes tie (a
    gradient of few distinct values) the kept magnitudes are still a top k of the chunk."""
    from grace_dgc.compressors.chunk_topk import group_size

    assert group_size(chunk, k) > 1
    comp = COMPRESSORS.get("chunk_topk")(chunk=chunk, k=k)
    gen = torch.Generator().manual_seed(chunk + k)
    for x in (torch.randn(3 * chunk, generator=gen), torch.randint(-3, 4, (3 * chunk,), generator=gen).float()):
        blocks = x.view(3, chunk)
        offsets, values = torch.empty(3, k, dtype=torch.int64), torch.empty(3, k)
        comp._whole_chunks(blocks, offsets.view(-1), values.view(-1))
        assert torch.equal(values, blocks.gather(1, offsets))
        assert bool((offsets.diff(dim=1) > 0).all())  # ascending, no offset twice
        top = torch.topk(blocks.abs(), k, dim=1)
        kept = blocks.abs().gather(1, offsets).sort(dim=1, descending=True).values
        assert torch.equal(kept, top.values)
        if x.unique().numel() > 7:  # no ties: the very same positions
            assert torch.equal(offsets, top.indices.sort(dim=1).values)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 200), st.sampled_from([1, 2, 4, 8]), st.sampled_from([2.0, 6.0]))
def test_statq_equals_the_reference_code_for_code(seed, n, bits, range_sigmas):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3 + 1
    comp = COMPRESSORS.get("statq")(bits=bits, range_sigmas=range_sigmas)
    payload, ctx = comp.compress(x, "w")
    codes, expected = reference_statq(x, bits, range_sigmas)
    assert grace_dgc.wire.unpack_bits(payload[0], bits, n).tolist() == codes
    assert payload[1].numel() == 2**bits + 1 and payload[0].numel() == math.ceil(n * bits / 8)
    torch.testing.assert_close(comp.decompress(payload, ctx), expected.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("bits", [1, 2, 8])
@pytest.mark.filterwarnings("error")
def test_statq_of_a_non_finite_gradient_warns_nothing_and_sends_a_non_finite_table(bits, bad):
    """One NaN or infinity makes the statistics non-finite: every code is 0 (NaN casts to it, as
    before the numpy cast) and no RuntimeWarning escapes; the table says what happened (μ non-finite),
    so a Grace's non-finite policy sees it."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(bits))
    x[3] = bad
    payload, _ = COMPRESSORS.get("statq")(bits=bits).compress(x, "w")
    assert not payload[0].any() and not math.isfinite(float(payload[1][0]))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.data())
def test_statq_counts_each_code_from_the_packed_bytes_padding_aside(bits, data):
    from grace_dgc.compressors.statq import code_counts

    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=1, max_size=300))
    packed = grace_dgc.wire.pack_bits(torch.tensor(codes, dtype=torch.uint8), bits)
    expected = [codes.count(j) for j in range(2**bits)]  # counted one by one
    assert code_counts(packed, bits, len(codes)).tolist() == expected


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_statq_over_several_chunks_is_the_reference_and_the_same_under_any_threads(bits):
    """On a CPU statq codes and bins chunk by chunk (fixed chunks of CPU_CHUNK, each bin's sum in
    float64 in chunk order, issue 58): over a tensor of three chunks its codes are the float64
    reference's (but on a bin's edge), its table each bin's mean, its table decode the elementwise
    lookup bit for bit, and 1 or 2 threads give the same payload bit for bit."""
    from grace_dgc.workspace import CPU_CHUNK

    n = 2 * CPU_CHUNK + 12_345
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    comp = COMPRESSORS.get("statq")(bits=bits)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone, ctx = comp.compress(x, "w")
        torch.set_num_threads(2)
        shared, _ = comp.compress(x, "w")
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))
    codes, _ = reference_statq_float64(x, bits, 6.0)
    unpacked = grace_dgc.wire.unpack_bits(alone[0], bits, n).long()
    # fp32 against float64 arithmetic: a code may differ by one where x sits on a bin's edge
    assert (unpacked - codes).abs().max() <= 1 and int((unpacked != codes).sum()) <= n // 10_000
    centered = x.double() - x.double().mean()  # each bin's mean of what it holds, in float64
    means = torch.bincount(unpacked, weights=centered, minlength=2**bits) / torch.bincount(
        unpacked, minlength=2**bits
    ).clamp(min=1)
    torch.testing.assert_close(alone[1][1:].double(), means, rtol=1e-6, atol=1e-6)
    decoded = comp.decompress(alone, ctx)
    assert torch.equal(decoded, (alone[1][1:] + alone[1][0]).index_select(0, unpacked))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 200), st.floats(1e-3, 1e3))
def test_fp4_is_the_nearest_e3m0_value_under_a_power_of_two_scale(seed, n, magnitude):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * magnitude
    x[0] = 0.0
    comp = COMPRESSORS.get("fp4")()
    payload, ctx = comp.compress(x, "w")
    assert [t.numel() * t.element_size() for t in payload] == [math.ceil(n / 2), 4]
    assert torch.equal(comp.decompress(payload, ctx), reference_fp4(x).float())


def fp4_edges() -> list[float]:
    """Where fp4's rounding turns: each field's value, the midpoints between neighbours (ties
    round up) and their fp32 neighbours, the 2^−7 threshold, ±0 and subnormals."""
    out = [0.0, -0.0, 1e-45, 1e-40, 1.0]
    for e in range(-9, 1):
        for v in (2.0**e, 1.5 * 2.0 ** (e - 1)):
            out += [v, math.nextafter(v, 0.0), math.nextafter(v, 2.0)]
    return [sign * v for v in out for sign in (1, -1)]


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True)),
    st.sampled_from([1.0, 2.0**-90, 3.0**40, 0.75]),
    st.booleans(),
)
def test_fp4s_bit_path_is_the_elementwise_path_bit_for_bit(values, factor, edges):
    """On a CPU fp4 encodes and decodes on the fp32 bits, chunk by chunk (112x -> 6x one copy_
    at 25M, issue 58); it must give the elementwise ops' codes and values bit for bit, at every
    rounding edge, for ±0, subnormals and any power-of-two scale (beyond 2^±100 and for a
    non-finite peak the elementwise ops run)."""
    from grace_dgc.compressors.fp4 import FIELDS, SIGN, _codes, _power_of_two

    x = torch.from_numpy(values) * factor
    if edges:
        x = torch.cat([x, torch.tensor(fp4_edges()) * float(x.abs().max() or 1.0)])
    comp = COMPRESSORS.get("fp4")()
    payload, ctx = comp.compress(x, "w")
    scale = payload[1]
    peak = float(x.abs().max())
    assert factor != 1.0 or 0 < peak < 2.0**-100 or _power_of_two(scale) is not None  # the bit path ran
    codes = grace_dgc.wire.unpack_bits(payload[0], 4, x.numel())
    assert torch.equal(codes, _codes(x.reshape(-1).float(), scale[0]))
    field = codes.to(torch.int32) & FIELDS  # the values by elementwise ops: ±s·2^(e−7), e = 0 is ±0
    magnitude = torch.where(field > 0, torch.exp2((field - FIELDS).float()) * scale, torch.zeros(()))
    expected = torch.where(codes >= SIGN, -magnitude, magnitude)
    decoded = comp.decompress(payload, ctx)
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))  # -0.0 included
    if math.isfinite(peak):
        assert torch.equal(decoded, reference_fp4(x).float())


def test_fp4_with_a_nan_or_an_infinity_takes_the_elementwise_path():
    from grace_dgc.compressors.fp4 import _codes

    comp = COMPRESSORS.get("fp4")()
    for x in (torch.tensor([float("nan"), 1.0, -2.0]), torch.tensor([float("inf"), 0.5, -0.25])):
        payload, _ = comp.compress(x, "w")
        assert torch.equal(grace_dgc.wire.unpack_bits(payload[0], 4, 3), _codes(x, payload[1][0]))


def test_sparseloco_chain_bytes_and_error_feedback_over_the_whole_composition():
    """k of every chunk in 2 bits + 12-bit offsets + μ and the 4-entry table; e ← βe + g then
    e ← e − Δ̂ exactly (β = 0.95: nothing is lost but what the decay forgets)."""
    grace = grace_dgc.sparseloco_grace(chunk=64, k=4, engine="local")
    comp = grace.compressor
    assert grace.compressor.registered_name == "chunk_topk>statq" and grace.memory.beta == 0.95
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    payload, _ = comp.compress(x, "w")
    kept = 4 * 4 + math.ceil(4 * 44 / 64)  # four whole chunks and 44 elements
    assert sum(t.numel() * t.element_size() for t in payload) == math.ceil(kept * 2 / 8) + 4 * 5 + math.ceil(
        kept * 6 / 8
    )
    gen, e = torch.Generator().manual_seed(1), torch.zeros(300)
    for _ in range(4):
        g = torch.randn(300, generator=gen)
        e = 0.95 * e + g
        sent = grace.step(g, "w")
        e = e - sent
        torch.testing.assert_close(grace.memory.residuals["w"], e, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(sent) <= kept


def test_sparseloco_schedule_is_outer_sgd_without_momentum_on_the_compressed_delta():
    """One rank, written out: after H inner SGD steps, e ← βe + Δ, Δ̂ = D(C(e)), e ← e − Δ̂,
    θ ← θ_start − α·Δ̂ (α = 1)."""
    H, rounds, lr = 3, 3, 0.1
    model = make_model()
    grace = grace_dgc.sparseloco_grace(chunk=16, k=4, engine="local")
    sched = schedules.create(
        "sparseloco", torch.optim.SGD(model.parameters(), lr=lr), grace, model.named_parameters(), inner_steps=H
    )
    assert (sched.outer_lr, sched.outer_momentum, sched.nesterov) == (1.0, 0.0, False)
    twin = grace_dgc.sparseloco_grace(chunk=16, k=4, engine="local").compressor  # the same C, by hand
    reference = make_model()
    names = [n for n, _ in reference.named_parameters()]
    theta = [p.detach().clone() for p in reference.parameters()]
    start, errors = [t.clone() for t in theta], [torch.zeros_like(t) for t in theta]
    for step, (x, y) in enumerate(batches(0, H * rounds)):
        opt_step(model, sched, x, y)
        for p, t in zip(reference.parameters(), theta):
            p.data.copy_(t)
        reference.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        theta = [t - lr * p.grad for t, p in zip(theta, reference.parameters())]
        if (step + 1) % H == 0:
            for i, name in enumerate(names):
                errors[i] = 0.95 * errors[i] + (start[i] - theta[i])
                sent = twin.decompress(*twin.compress(errors[i], name))
                errors[i] = errors[i] - sent
                theta[i] = start[i] - 1.0 * sent
            start = [t.clone() for t in theta]
        for p, t in zip(model.parameters(), theta):
            torch.testing.assert_close(p.detach(), t, rtol=1e-5, atol=1e-6)
    assert sched.syncs == rounds


def opt_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_sparseloco_refuses_a_grace_without_error_feedback():
    model = make_model()
    with pytest.raises(GraceConfigError, match="error feedback"):
        schedules.create(
            "sparseloco",
            torch.optim.SGD(model.parameters(), lr=0.1),
            grace_dgc.build("chunk_topk>statq", "none", "allgather", engine="local"),
        )
    with pytest.raises(GraceConfigError, match="k=9 is more than a chunk"):
        COMPRESSORS.get("chunk_topk")(chunk=8, k=9)
    with pytest.raises(GraceConfigError, match="bits=3"):
        COMPRESSORS.get("statq")(bits=3)


def ranks_job(rank: int, world: int) -> list:
    grace = grace_dgc.sparseloco_grace(chunk=32, k=2)
    gen = torch.Generator().manual_seed(rank)
    return [grace.step(torch.randn(100, generator=gen), "w") for _ in range(3)]


def test_sparseloco_ranks_agree_bitwise_on_two_ranks():
    outs = run_ranks(ranks_job, 2)
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    assert all(0 < torch.count_nonzero(o) <= 2 * (3 * 2 + 1) for o in outs[0])
