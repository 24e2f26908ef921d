"""qsgd, twobit, terngrad, natural: unbiasedness, exact values, wire bytes, bit packing,
multi-rank aggregation. References are written here independently of the modules."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import run_ranks

import grace_dgc
from grace_dgc import wire
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS

METHODS = {"qsgd": {"quantum_num": 64, "bucket_size": 512}, "twobit": {"threshold": 0.5}, "terngrad": {}, "natural": {}}
STOCHASTIC = ("qsgd", "terngrad", "natural")


def make(name, **params):
    return COMPRESSORS.get(name)(**params)


def roundtrip(compressor, tensor, name="t"):
    payload, ctx = compressor.compress(tensor, name)
    return compressor.decompress(payload, ctx)


def clipped_reference(x, factor=2.5):
    """TernGrad's clipping, written independently (float64)."""
    sigma = x.double().std(correction=0)
    return x.double().clamp(-factor * sigma, factor * sigma) if sigma > 0 else x.double()


def two_point_reference(name, x, **params):
    """The two values each element is rounded between, low ≤ x ≤ high, and P(high), float64."""
    x = x.double()
    if name == "qsgd":  # one bucket: the whole of x
        s = params["quantum_num"]
        unit = x.norm() / s
        low = (x.abs() / unit).floor() * unit
        return low, low + unit, (x.abs() - low) / unit, x.sign()
    if name == "terngrad":
        clipped = clipped_reference(x)
        scale = clipped.abs().max()
        return torch.zeros_like(x), scale.expand_as(x), clipped.abs() / scale, clipped.sign()
    low = 2.0 ** torch.floor(torch.log2(x.abs()))  # natural
    return low, 2 * low, x.abs() / low - 1, x.sign()


# -- unbiasedness ---------------------------------------------------------------------


@pytest.mark.parametrize("name", STOCHASTIC)
def test_mean_of_many_draws_converges_to_the_input(name):
    """T independent draws at once: x repeated T times keeps every per-tensor statistic
    (σ and max for terngrad; the one bucket's norm for qsgd, bucket_size = n), so the T
    rows are T draws for x. Bernstein's inequality with the two-point variance computed
    here bounds |mean − E| at failure probability ≤ 1e-6 per element."""
    torch.manual_seed(3)
    n, draws = 256, 4000
    x = torch.randn(n) * torch.logspace(-3, 2, n)
    params = {"quantum_num": 4, "bucket_size": n, "seed": 11} if name == "qsgd" else {"seed": 11}
    out = roundtrip(make(name, **params), x.repeat(draws)).double().view(draws, n)
    low, high, p_high, sign = two_point_reference(name, x, **params)
    # every draw is one of the two bracketing values
    assert torch.all(
        torch.isclose(out.abs(), low, rtol=1e-5, atol=0) | torch.isclose(out.abs(), high, rtol=1e-5, atol=0)
    )
    assert torch.all(out * sign >= 0)
    expected = sign * (low + p_high * (high - low))
    if name == "terngrad":
        assert torch.allclose(expected, clipped_reference(x))
    else:
        assert torch.allclose(expected, x.double())
    variance = (high - low) ** 2 * p_high * (1 - p_high)
    t = math.log(2 / 1e-6)
    bound = (2 * variance * t / draws).sqrt() + 2 / 3 * (high - low) * t / draws + 1e-6 * high
    assert torch.all((out.mean(0) - expected).abs() <= bound)


# -- exact values -----------------------------------------------------------------------


def test_twobit_values_and_bit_layout_by_hand():
    x = torch.tensor([0.7, 0.5, 0.49, -0.5, -0.51, 0.0, -3.0, 2.0])
    compressor = make("twobit", threshold=0.5)
    (packed,), ctx = compressor.compress(x, "t")
    # codes 11 11 00 10 10 00 10 11, element i at bits 2i.. of the little-endian stream
    assert packed.tolist() == [0b10_00_11_11, 0b11_10_00_10]
    assert compressor.decompress([packed], ctx).tolist() == [0.5, 0.5, 0, -0.5, -0.5, 0, -0.5, 0.5]
    # 16 elements per 32-bit word: element j of a word at bits 2j, 2j+1
    y = torch.zeros(16)
    y[5], y[15] = 1.0, -1.0
    (word,), _ = compressor.compress(y, "t")
    assert int.from_bytes(bytes(word.tolist()), "little") == (0b11 << 10) | (0b10 << 30)


def test_twobit_with_residual_is_mxnet_error_feedback():
    grace = grace_dgc.build("twobit", "residual", "allgather", engine="local", threshold=0.5)
    gradient = torch.tensor([0.2, -0.3, 0.6, 0.0])
    residual, sent = torch.zeros(4), []
    for _ in range(4):  # hand-written MXNet loop: quantise the residual-added gradient
        total = residual + gradient
        q = torch.where(total >= 0.5, 0.5, torch.where(total <= -0.5, -0.5, 0.0))
        residual = total - q
        sent.append(q)
    for expected in sent:
        assert torch.allclose(grace.step(gradient, "g"), expected)


def test_qsgd_exact_levels_and_zero_bucket():
    # |v|/‖v‖·s are integers (3/5·5, 4/5·5): no randomness, the output is v itself
    x = torch.tensor([3.0, -4.0, 0.0, 0.0])
    out = roundtrip(make("qsgd", quantum_num=5, bucket_size=2), x)
    assert out.tolist() == [3.0, -4.0, 0.0, 0.0]
    # levels: |out|·s/‖bucket‖ are integers in [0, s], ⌊·⌋ or ⌈·⌉ of the exact level
    torch.manual_seed(0)
    x = torch.randn(1000)
    s, bucket = 3, 100
    out = roundtrip(make("qsgd", quantum_num=s, bucket_size=bucket, seed=5), x)
    norms = x.view(-1, bucket).norm(dim=1, keepdim=True)
    levels = out.view(-1, bucket).abs() * s / norms
    exact = x.view(-1, bucket).abs() * s / norms
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert torch.all((levels.round() == exact.floor()) | (levels.round() == exact.floor() + 1))
    assert torch.all(levels.round() <= s) and torch.all(out * x >= 0)


def test_terngrad_values_are_zero_or_signed_scale():
    torch.manual_seed(1)
    x = torch.randn(5000)
    x[7] = 100.0  # an outlier the clipping removes
    out = roundtrip(make("terngrad", seed=2), x).double()
    scale = clipped_reference(x).abs().max()
    assert scale < 10
    assert torch.all((out == 0) | torch.isclose(out.abs(), scale.expand_as(out)))
    assert torch.all(out * x >= 0) and (out != 0).any()
    # a constant tensor (σ = 0) is not clipped to 0: every element is sent as the value
    assert roundtrip(make("terngrad"), torch.full((6,), -2.0)).tolist() == [-2.0] * 6


def test_natural_outputs_signed_powers_of_two_bracketing_the_input():
    torch.manual_seed(2)
    x = torch.randn(10000) * torch.logspace(-30, 30, 10000)
    out = roundtrip(make("natural", seed=3), x).double()
    low = 2.0 ** torch.floor(torch.log2(x.double().abs()))
    assert torch.all((out.abs() == low) | (out.abs() == 2 * low))
    assert torch.all(torch.sign(out) == torch.sign(x.double()))
    special = torch.tensor(
        [0.0, -0.0, 1.0, -0.25, 2.0**-126, 2.0**127, 3e38, float("inf"), -float("inf"), float("nan")]
    )
    out = roundtrip(make("natural"), special)
    assert out.tolist() == [
        0.0,
        0.0,
        1.0,
        -0.25,
        2.0**-126,
        2.0**127,
        2.0**127,  # saturates at 2^127
        float("inf"),
        -float("inf"),
        float("inf"),
    ]
    assert torch.signbit(out[1])  # even -0.0 keeps its sign
    tiny = roundtrip(make("natural"), torch.full((1000,), 1e-40))  # subnormal: 0 or 2^-126
    assert set(tiny.tolist()) == {0.0, 2.0**-126}


# -- bytes on the wire ----------------------------------------------------------------------


def expected_bytes(name, n, params):
    """Packed payload size computed here + the allgather header (int64 per payload tensor)."""
    if name == "qsgd":
        bits = (2 * params["quantum_num"]).bit_length()  # = ⌈log2(2s+1)⌉
        return (n * bits + 7) // 8 + 4 * -(-n // params["bucket_size"]) + 2 * 8
    if name == "twobit":
        return -(-n // 4) + 8
    if name == "terngrad":
        return -(-n // 4) + 4 + 2 * 8
    return n + -(-n // 8) + 2 * 8  # natural: exponent bytes + sign bits


@pytest.mark.parametrize(
    "name,params",
    [
        *METHODS.items(),
        ("qsgd", {"quantum_num": 127, "bucket_size": 100}),
        ("qsgd", {"quantum_num": 200, "bucket_size": 7}),
        ("qsgd", {"quantum_num": 2**20, "bucket_size": 1000}),
    ],
)
@pytest.mark.parametrize("n", [0, 1, 13, 1000, 4099])
def test_bytes_sent_is_the_packed_size(name, params, n):
    grace = grace_dgc.build(name, "none", "allgather", engine="local", **params)
    x = torch.randn(n)
    out = grace.step(x, "g")
    assert grace.stats()["bytes_sent"] == expected_bytes(name, n, params)
    assert out.shape == x.shape


def test_wide_qsgd_levels_roundtrip():
    # 2^20 levels need 22 bits: the wide packing path, levels still bracket the input
    x = torch.randn(3001)
    out = roundtrip(make("qsgd", quantum_num=2**20, bucket_size=3001), x)
    assert torch.allclose(out, x, atol=x.norm().item() / 2**20 * 1.01, rtol=0)


# -- bit packing ------------------------------------------------------------------------------


def reference_pack(codes, bits):
    stream = [(c >> i) & 1 for c in codes for i in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(stream[k + i] << i for i in range(8)) for k in range(0, len(stream), 8)]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pack_bits_roundtrip_every_width(data):
    bits = data.draw(st.integers(1, wire.MAX_BITS))
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=41))
    tensor = torch.tensor(codes, dtype=torch.int64)
    packed = wire.pack_bits(tensor, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == wire.packed_nbytes(len(codes), bits)
    assert packed.tolist() == reference_pack(codes, bits)
    assert wire.unpack_bits(packed, bits, len(codes)).tolist() == codes


@pytest.mark.parametrize("bits", [0, 33, 2.5, True])
def test_pack_bits_rejects_bad_widths(bits):
    with pytest.raises(ValueError, match="accepted: integers 1..32"):
        wire.pack_bits(torch.zeros(3, dtype=torch.int64), bits)


# -- shapes, dtypes, state, parameters -----------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 5, 7), (0,), (1,), (2, 0, 3)])
def test_shape_and_dtype_preserved(name, dtype, shape):
    x = torch.randn(shape).to(dtype)
    original = x.clone()
    out = roundtrip(make(name), x)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(x, original)  # the input is never written to


@pytest.mark.parametrize("name", STOCHASTIC)
def test_seeded_streams_resume_from_state_and_leave_global_rng_alone(name):
    x = torch.randn(300)
    rng = torch.get_rng_state()
    first = make(name, seed=4)
    outs = [roundtrip(first, x, "w") for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.equal(outs[1], outs[2])  # a fresh draw each step
    resumed = make(name, seed=4)
    replay = make(name, seed=4)
    roundtrip(replay, x, "w")
    resumed.load_state_dict(replay.state_dict())
    assert torch.equal(roundtrip(resumed, x, "w"), outs[1])
    assert not torch.equal(roundtrip(make(name, seed=5), x, "w"), outs[0])


@pytest.mark.parametrize(
    "name,params,word",
    [
        ("qsgd", {"quantum_num": 0}, "quantum_num"),
        ("qsgd", {"quantum_num": 2**24}, "quantum_num"),
        ("qsgd", {"bucket_size": 0}, "bucket_size"),
        ("twobit", {"threshold": 0}, "threshold"),
        ("terngrad", {"clip_factor": -1}, "clip_factor"),
        ("natural", {"seed": -1}, "seed"),
        ("qsgd", {"seed": 1.5}, "seed"),
    ],
)
def test_bad_parameters_are_named(name, params, word):
    with pytest.raises(GraceConfigError, match=word):
        make(name, **params)


@pytest.mark.parametrize("name", METHODS)
def test_build_refuses_allreduce(name):
    assert not COMPRESSORS.get(name).summable
    with pytest.raises(GraceConfigError, match="cannot be summed"):
        grace_dgc.build(name, "none", "allreduce", engine="local")
    assert COMPRESSORS.get("2bit") is COMPRESSORS.get("twobit")


# -- two ranks over gloo --------------------------------------------------------------------------

SEED = 17
CASES = [(name, comm) for name in METHODS for comm in ("allgather", "broadcast")]


def rank_input(rank, case):
    return torch.randn((31, 17), generator=torch.Generator().manual_seed(100 * case + rank))


def two_rank_worker(rank, world_size):
    results = []
    for case, (name, comm) in enumerate(CASES):
        grace = (
            grace_dgc.build(name, "none", comm, engine="torch", seed=SEED, **METHODS[name])
            if name in STOCHASTIC
            else grace_dgc.build(name, "none", comm, engine="torch", **METHODS[name])
        )
        results.append(grace.step(rank_input(rank, case), f"layer{case}"))
    return results


def test_two_ranks_average_each_ranks_decompressed_tensor():
    per_rank = run_ranks(two_rank_worker, 2)
    for case, (name, comm) in enumerate(CASES):
        decompressed = []
        for rank in range(2):  # rank r's stream is rank 0's with seed + r
            params = dict(METHODS[name], seed=SEED + rank) if name in STOCHASTIC else METHODS[name]
            decompressed.append(roundtrip(make(name, **params), rank_input(rank, case), f"layer{case}"))
        expected = (decompressed[0] + decompressed[1]) / 2
        assert not torch.equal(decompressed[0], decompressed[1])
        for rank in range(2):
            torch.testing.assert_close(
                per_rank[rank][case], expected, rtol=1e-6, atol=1e-7, msg=f"{name} over {comm}, rank {rank}"
            )


def test_sent_mask_every_element_for_unbiased_methods_and_pm_tau_for_twobit():
    x = torch.tensor([[0.7, -0.2], [0.0, -0.6]])
    for name in STOCHASTIC:
        compressor = make(name)
        assert compressor.sent_mask(*compressor.compress(x, "m")).tolist() == [[True, True], [True, True]]
    twobit = make("twobit", threshold=0.5)
    assert twobit.sent_mask(*twobit.compress(x, "m")).tolist() == [[True, False], [False, True]]


def test_qsgds_norms_without_host_reads_are_the_ones_with_them():
    """On a GPU qsgd repairs its overflowed bucket norms with no host read (every row's scaled
    norm and a select, issue 58): the CPU's bits (only the overflowed rows' scaled norms), and the
    scaled norm m·‖v/m‖ where ‖v‖² overflowed fp32: finite, within 1e-6 of the fp64 norm."""
    from grace_dgc.compressors.qsgd import repair_norms

    rows = torch.randn(6, 33, generator=torch.Generator().manual_seed(0))
    rows[1] *= 1e20  # ‖v‖² beyond fp32
    rows[2, 3] = float("nan")
    rows[3, 0] = float("inf")
    rows[4] = 0.0
    rows[5, :4] = 1.5e38  # ‖v‖ = 3e38: finite, its square not
    results = []
    for host_reads in (True, False):
        norms = rows.norm(dim=1)
        repair_norms(norms, rows, host_reads=host_reads)
        results.append(norms)
    assert torch.equal(results[0].isnan(), results[1].isnan())
    assert torch.equal(results[0].nan_to_num(), results[1].nan_to_num())
    wide = rows.double().norm(dim=1)
    assert results[0][2].isnan() and results[0][3] == math.inf and results[0][4] == 0.0
    for row in (0, 1, 5):
        assert math.isfinite(results[0][row]) and abs(results[0][row].item() / wide[row].item() - 1) < 1e-6
