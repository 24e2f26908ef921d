"""thc: the Hadamard transform, exact levels against a numpy reference, unbiasedness, the
multi-rank sum over allreduce (bitwise equal ranks, conservation with error feedback, the
wire dtype at the scale's edge), checkpoints and refusals. References are written here."""

import functools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.linalg
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS

SEED, STEPS = 11, 3
SHAPES = {"w": (31, 17), "b": (5,)}  # d = 1024 and 8
EDGE_BITS = (6, 7, 8)  # N·K at N = 2: 62, 126, 254; at N = 3: 93, 189, 381


def make(**params):
    return COMPRESSORS.get("thc")(**params)


@functools.lru_cache
def hadamard_matrix(d):
    return scipy.linalg.hadamard(d) / math.sqrt(d)


def padded_length(n):
    return 1 << max(n - 1, 0).bit_length()


def signs_of(name, step, n, seed=SEED):
    from grace_dgc.compressors.thc import rotation_signs

    return rotation_signs(seed, name, step, padded_length(n), "cpu").double().numpy()


def reference_rotation(x, signs):
    """x' = H·D·x/√d in float64 (numpy), x zero-padded to d."""
    flat = np.zeros(signs.size)
    flat[: x.numel()] = x.double().reshape(-1).numpy()
    return hadamard_matrix(signs.size) @ (signs * flat)


def reference_decode(codes, scale, levels, signs, shape):
    """D·H·(codes·M/K)/√d, truncated to the shape's elements (float64)."""
    rotated = codes.double().numpy() * float(scale) / levels
    flat = rotated if signs is None else signs * (hadamard_matrix(signs.size) @ rotated)
    return torch.from_numpy(flat[: math.prod(shape)].reshape(shape))


# -- (a) the transform -----------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hadamard_is_scipys_orthonormal_matrix_and_its_own_inverse(d, dtype):
    from grace_dgc.compressors.thc import hadamard

    x = torch.randn(d, generator=torch.Generator().manual_seed(d), dtype=torch.float64).to(dtype)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    expected = torch.from_numpy(hadamard_matrix(d) @ x.double().numpy())
    torch.testing.assert_close(hadamard(x).double(), expected, **tol)
    torch.testing.assert_close(hadamard(hadamard(x)), x, **tol)
    assert hadamard(x).dtype == dtype


def test_hadamard_refuses_a_length_that_is_not_a_power_of_two():
    from grace_dgc.compressors.thc import hadamard

    with pytest.raises(ValueError, match="power-of-two length, got 6"):
        hadamard(torch.ones(6))


def test_every_rank_rotates_alike_and_each_step_afresh():
    ranks = [make(seed=SEED) for _ in range(3)]
    for rank, compressor in enumerate(ranks):
        compressor.bind(SimpleNamespace(rank=rank, size=1))  # no pre-round: one rank
    x = torch.randn(40, generator=torch.Generator().manual_seed(0))
    (codes0,), ctx0 = ranks[0].compress(x, "w")
    for compressor in ranks[1:]:
        (codes,), ctx = compressor.compress(x, "w")
        assert torch.equal(ctx.signs, ctx0.signs)  # D: no rank in its seed
        assert not torch.equal(codes, codes0)  # the rounding: each rank its own stream
    assert not torch.equal(ranks[0].compress(x, "w")[1].signs, ctx0.signs)  # step 1: another D


# -- (a′) the same bits as before the restructuring ---------------------------------------------


def former_hadamard(x):
    """thc.hadamard as first written: a clone, then each stage's add and sub into the other buffer."""
    d = x.numel()
    a, b, h = x.clone(), torch.empty_like(x), 1
    while h < d:
        pairs, into = a.view(-1, 2, h), b.view(-1, 2, h)
        torch.add(pairs[:, 0], pairs[:, 1], out=into[:, 0])
        torch.sub(pairs[:, 0], pairs[:, 1], out=into[:, 1])
        a, b, h = b, a, 2 * h
    return a.mul_(d**-0.5)


def former_round_trip(x, bits, rotate, step=0, name="w", size=1, seed=SEED):
    """thc's compress (one rank, no pre-round) and decompress as first written, op for op:
    zeros, a copy, the signs' product, the transform, |x|.amax(), the nine rounding ops; on
    decoding the codes' product, the transform, the signs over all d, a copy of the first n."""
    from grace_dgc.compressors.stochastic import StochasticCompressor
    from grace_dgc.compressors.thc import rotation_signs

    flat = x.detach().reshape(-1).float()
    signs = None
    if rotate:
        d = padded_length(flat.numel())
        signs = rotation_signs(seed, name, step, d, flat.device)
        padded = torch.zeros(d, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        flat = former_hadamard(padded.mul_(signs))
    scale = flat.abs().amax() if flat.numel() else flat.new_zeros(())
    K = 2 ** (bits - 1) - 1
    u = torch.mul(flat, torch.where(scale > 0, K / scale, 0.0))
    u.nan_to_num_(nan=0.0, posinf=K, neginf=-K).clamp_(-K, K)
    streams = StochasticCompressor(seed)
    streams.steps[name] = step
    uniform = torch.rand(u.numel(), generator=streams.generator(name, u.device), device=u.device)
    q = torch.floor(u)
    q.add_(uniform.lt_(u.sub_(q)))
    codes = q.to(torch.int8 if size * K <= 127 else torch.int32)
    decoded = codes.to(torch.float32).mul_(scale / K)
    if signs is not None:
        decoded = former_hadamard(decoded).mul_(signs)
    out = torch.full_like(x, 7.0)
    out.copy_(decoded[: out.numel()].view(out.shape))
    return codes, scale, out


def bits_of(t):
    return t.contiguous().view(-1).view(torch.uint8)


FORMER_SIZES = [0, 1, 2, 3, 5, 64, 100, 1023, 1024, 1025, 4097, 20000]


@pytest.mark.parametrize("n", FORMER_SIZES)
@pytest.mark.parametrize("rotate", [True, False])
def test_the_codes_scale_and_decoded_tensor_are_the_former_ones_bit_for_bit(n, rotate):
    """The torch path (the padding written once, the transform in place, max|x| from aminmax,
    the signs and the cast over the n kept elements) gives what the first version gave."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    x[::7] = 0.0
    x[1::11] = -0.0
    for step, bits in enumerate((2, 4, 8)):
        compressor = make(bits=bits, rotate=rotate, seed=SEED)
        compressor.steps["w"] = step
        (codes,), ctx = compressor.compress(x, "w")
        out = torch.full_like(x, 7.0)
        compressor.decompress_into([codes], ctx, out)
        former_codes, former_scale, former_out = former_round_trip(x, bits, rotate, step)
        assert torch.equal(bits_of(codes), bits_of(former_codes)) and codes.dtype == former_codes.dtype
        assert torch.equal(bits_of(ctx.scale), bits_of(former_scale))
        assert torch.equal(bits_of(out), bits_of(former_out))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_decode_like_the_former_code(dtype):
    """A gradient of another dtype: rotated as fp32, decoded through an fp32 buffer into it."""
    x = (torch.randn(37, 29, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    compressor = make(seed=SEED)
    (codes,), ctx = compressor.compress(x, "w")
    out = torch.full_like(x, 7.0)
    compressor.decompress_into([codes], ctx, out)
    former_codes, _, former_out = former_round_trip(x, 4, True)
    assert torch.equal(codes, former_codes) and torch.equal(bits_of(out), bits_of(former_out))
    contiguous, noncontiguous = torch.empty(37, 29), torch.full((29, 37), 7.0).t()  # fp32, the second not contiguous
    compressor.decompress_into([codes], ctx, contiguous)
    compressor.decompress_into([codes], ctx, noncontiguous)
    assert torch.equal(bits_of(noncontiguous), bits_of(contiguous))
    assert torch.equal(bits_of(contiguous.to(dtype)), bits_of(former_out))


def test_largest_keeps_the_former_bits_for_signed_zeros_infinities_and_nan():
    from grace_dgc.compressors.thc import _largest

    cases = [[-0.0, -0.0], [0.0, -0.0], [-3.0, 2.0], [1e-45, -2e-45], [float("-inf"), 1.0], [5.0], []]
    for values in cases:
        x = torch.tensor(values, dtype=torch.float32)
        expected = x.abs().amax() if x.numel() else x.new_zeros(())
        assert torch.equal(bits_of(_largest(x)), bits_of(expected)), values
    assert _largest(torch.tensor([1.0, float("nan"), -2.0])).isnan()


# -- (b) one rank against the reference --------------------------------------------------


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_one_rank_codes_are_floor_or_ceil_and_decode_like_the_reference(rotate, bits):
    compressor = make(bits=bits, rotate=rotate, seed=SEED)
    levels = 2 ** (bits - 1) - 1
    x = torch.randn(37, 5, generator=torch.Generator().manual_seed(bits))
    for step in range(2):
        (codes,), ctx = compressor.compress(x, "w")
        signs = signs_of("w", step, x.numel()) if rotate else None
        rotated = reference_rotation(x, signs) if rotate else x.double().reshape(-1).numpy()
        scale = np.abs(rotated).max()
        u = rotated * levels / scale
        assert codes.dtype == torch.int8 and codes.numel() == (256 if rotate else 185)
        assert math.isclose(float(ctx.scale), scale, rel_tol=1e-6)
        got = codes.double().numpy()
        assert np.all(got >= np.floor(u - 1e-4)) and np.all(got <= np.ceil(u + 1e-4)), "a code beyond ⌊u⌋, ⌈u⌉"
        assert np.abs(got).max() <= levels
        expected = reference_decode(codes, scale, levels, signs, x.shape)
        decoded = compressor.decompress([codes], ctx)
        assert decoded.dtype == x.dtype and decoded.shape == x.shape
        torch.testing.assert_close(decoded.double(), expected, rtol=1e-5, atol=1e-5)


def test_zeros_an_empty_tensor_and_a_nan():
    compressor = make(seed=SEED)
    for x in (torch.zeros(7, 3), torch.zeros(0), torch.zeros(1)):  # M = 0: codes 0, no NaN
        (codes,), ctx = compressor.compress(x, "z")
        assert not codes.any() and torch.equal(compressor.decompress([codes], ctx), x)
    grace = grace_dgc.build("thc", "residual", "allreduce", engine="local")
    assert torch.equal(grace.step(torch.zeros(4, 4), "z"), torch.zeros(4, 4))
    (codes,), ctx = compressor.compress(torch.tensor([1.0, float("nan"), -2.0]), "n")
    assert compressor.decompress([codes], ctx).isnan().all()  # documented: M is NaN everywhere


# -- (c) unbiasedness ---------------------------------------------------------------------


@pytest.mark.parametrize("rotate", [True, False])
def test_mean_over_many_seeds_converges_to_the_input(rotate):
    """E‖x̂ − x‖² ≤ d·(M/K)²/4 per draw (Bernoulli variance ≤ 1/4 per coordinate, an
    orthonormal rotation keeps the sum), so the mean of S independent draws has
    E‖mean − x‖² ≤ Σ_s d·(M_s/K)²/(4S²): the test allows 3× that."""
    x = torch.randn(50, generator=torch.Generator().manual_seed(5)).double()
    draws, bound = [], 0.0
    for seed in range(3000):
        compressor = make(bits=2, rotate=rotate, seed=seed)  # K = 1: the coarsest levels
        (codes,), ctx = compressor.compress(x, "u")
        draws.append(compressor.decompress([codes], ctx))
        bound += codes.numel() * float(ctx.scale) ** 2 / 4
    mean = torch.stack(draws).mean(dim=0)
    bound /= len(draws) ** 2
    error = float((mean - x).pow(2).sum())
    assert error <= 3 * bound, (error, bound)
    assert bound < 1e-3 * float(x.pow(2).sum())  # the bound says something
    assert float((draws[0] - x).pow(2).sum()) > 50 * error  # one draw is far noisier


# -- (d) several ranks -------------------------------------------------------------------


def gradient(rank, step, name):
    seed = 1000 * step + 10 * rank + list(SHAPES).index(name)
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed))


def recording(compressor):
    """Wrap ``compressor.compress``: every call's (name, codes, M), copied before the wire."""
    log, original = [], compressor.compress

    def compress(tensor, name):
        payload, ctx = original(tensor, name)
        log.append((name, payload[0].clone(), ctx.scale.clone()))
        return payload, ctx

    compressor.compress = compress
    return log


def edge_input(rotate, rank):
    """Every code ±K on every rank. rotate=False: elements ±M (the same on every rank, so
    the sum is ±N·K). rotate=True: a one-hot of 64 elements rotates to ±1/8 everywhere."""
    if rotate:
        return torch.nn.functional.one_hot(torch.tensor(3), 64).float()
    return torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0.5, -0.5] * 4)


def multi_rank_job(rank, world):
    out = {}
    for memory in ("none", "residual"):
        for comm in ("allreduce", "allgather"):
            grace = grace_dgc.build("thc", memory, comm, engine="torch", seed=SEED)
            log, outputs = recording(grace.compressor), []
            for step in range(STEPS):
                tensors = [gradient(rank, step, name) for name in SHAPES]
                outputs.append([t.clone() for t in grace.step_group_async(tensors, list(SHAPES)).result()])
            residuals = {n: r.clone() for n, r in grace.memory.residuals.items()} if memory == "residual" else {}
            out[memory, comm] = {
                "outputs": outputs,
                "log": log,
                "residuals": residuals,
                "bytes_sent": grace.stats()["bytes_sent"],
            }
    for bits in EDGE_BITS:
        for rotate in (False, True):
            grace = grace_dgc.build("thc", "none", "allreduce", engine="torch", seed=SEED, bits=bits, rotate=rotate)
            log = recording(grace.compressor)
            out["edge", bits, rotate] = (grace.step(edge_input(rotate, rank), "e").clone(), log[0][1])
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request):
    return request.param, run_ranks(multi_rank_job, request.param)


@pytest.mark.parametrize("memory", ["none", "residual"])
@pytest.mark.parametrize("comm", ["allreduce", "allgather"])
def test_every_rank_gets_the_average_of_the_ranks_dequantized_payloads(ranks, memory, comm):
    world, results = ranks
    for step in range(STEPS):
        for i, name in enumerate(SHAPES):
            outputs = [results[r][memory, comm]["outputs"][step][i] for r in range(world)]
            assert all(torch.equal(o, outputs[0]) for o in outputs), "ranks differ"
            logged = [results[r][memory, comm]["log"][len(SHAPES) * step + i] for r in range(world)]
            assert all(entry[0] == name for entry in logged)
            scale = logged[0][2]
            assert all(torch.equal(entry[2], scale) for entry in logged), "M differs between ranks"
            signs = signs_of(name, step, math.prod(SHAPES[name]))
            if memory == "none":  # M is the largest rotated magnitude over the ranks
                largest = max(np.abs(reference_rotation(gradient(r, step, name), signs)).max() for r in range(world))
                assert math.isclose(float(scale), largest, rel_tol=1e-6)
            expected = sum(reference_decode(e[1], scale, 7, signs, SHAPES[name]) for e in logged) / world
            torch.testing.assert_close(outputs[0].double(), expected, rtol=1e-5, atol=1e-6)
    # bytes per step: the int8 codes (d = 1024 + 8) and the pre-round's fp32 maximum per tensor
    if comm == "allreduce":
        assert results[0][memory, comm]["bytes_sent"] == STEPS * (1024 + 8 + 4 * 2)


@pytest.mark.parametrize("memory", ["none", "residual"])
def test_allgather_gives_allreduces_average_bit_for_bit(ranks, memory):
    world, results = ranks
    for r in range(world):
        for a, b in zip(results[r][memory, "allreduce"]["outputs"], results[r][memory, "allgather"]["outputs"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("comm", ["allreduce", "allgather"])
def test_error_feedback_conserves_the_mass(ranks, comm):
    """Σ_t N·output_t + Σ_r residual_r = Σ_{r,t} gradient: nothing is lost or made up."""
    world, results = ranks
    for i, name in enumerate(SHAPES):
        total = sum(gradient(r, t, name).double() for r in range(world) for t in range(STEPS))
        sent = sum(world * results[0]["residual", comm]["outputs"][t][i].double() for t in range(STEPS))
        kept = sum(results[r]["residual", comm]["residuals"][name].double() for r in range(world))
        torch.testing.assert_close(sent + kept, total, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", EDGE_BITS)
@pytest.mark.parametrize("rotate", [False, True])
def test_codes_at_the_scale_edge_sum_without_wrapping(ranks, bits, rotate):
    world, results = ranks
    levels = 2 ** (bits - 1) - 1
    dtype = torch.int8 if world * levels <= 127 else torch.int32
    for r in range(world):
        output, codes = results[r]["edge", bits, rotate]
        assert codes.dtype == dtype, f"N·K = {world * levels}"
        assert torch.equal(codes.abs(), torch.full_like(codes, levels)), "every code is ±K"
        torch.testing.assert_close(output, edge_input(rotate, r), rtol=1e-6, atol=1e-6)


# -- (e) checkpoints ------------------------------------------------------------------------


def test_state_dict_resumes_bit_for_bit():
    def steps(grace, first, count):
        return [grace.step(gradient(0, t, "w"), "w") for t in range(first, first + count)]

    grace = grace_dgc.build("thc", "residual", "allreduce", engine="local", seed=SEED)
    steps(grace, 0, 3)
    state = grace.state_dict()
    assert state["compressor"]["steps"] == {"w": 3}
    expected = steps(grace, 3, 2)
    resumed = grace_dgc.build("thc", "residual", "allreduce", engine="local", seed=SEED)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(steps(resumed, 3, 2), expected))


# -- (f) errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        ({"bits": 1}, r"bits=1 is out of range; accepted: \[2, 8\]"),
        ({"bits": 9}, r"bits=9 is out of range; accepted: \[2, 8\]"),
        ({"bits": 4.5}, r"bits=4.5 must be a number of type int"),
        ({"bits": "4"}, r"bits='4' must be a number"),
        ({"rotate": "yes"}, r"rotate='yes' must be True or False"),
        ({"rotate": 1}, r"rotate=1 must be True or False"),
        ({"seed": -1}, r"seed=-1 is out of range"),
    ],
)
def test_bad_parameters_name_the_parameter(params, message):
    with pytest.raises(GraceConfigError, match=message):
        grace_dgc.build("thc", "none", "allreduce", engine="local", **params)


@pytest.mark.parametrize(
    "comm",
    [
        "reduce_scatter",
        "sparse_allreduce",
        "hierarchical",
        "auto",
    ],
)
def test_communicators_that_cannot_agree_first_refuse_it_at_build(comm):
    with pytest.raises(GraceConfigError, match=rf"communicator '{comm}' cannot carry compressor 'thc': .*allreduce"):
        grace_dgc.build("thc", "none", comm, engine="local")


def test_compressing_without_the_pre_round_on_several_ranks_is_an_error():
    compressor = make()
    compressor.bind(SimpleNamespace(rank=0, size=2))
    with pytest.raises(GraceConfigError, match="thc: no scale agreed for 'w': on 2 ranks"):
        compressor.compress(torch.ones(3), "w")
