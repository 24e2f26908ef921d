"""PowerSGD (compressor + memory ``powersgd``) against PyTorch's ``powerSGD_hook`` on 1 and 2 gloo
ranks, against a numpy reference written here, and its wire size and checkpointing.

How the comparison with the hook is made honest:
  * The hook is the real ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``.
    ``dist.GradBucket`` has no Python constructor, so :class:`Bucket` stands in for it with the
    four methods the hook calls (``buffer``, ``index``, ``gradients``, ``is_last``); as in DDP,
    the gradients are views of the flat buffer, which the hook overwrites with the average.
  * The hook runs vanilla allreduce for its first ``start_powerSGD_iter`` (≥ 2) calls; they touch
    no PowerSGD state, so we make them on throw-away data and compare from its first PowerSGD call.
  * The initial Q is arbitrary by design, and the hook draws it per bucket (numpy RandomState
    → torch.manual_seed → randn per tensor, grouped by matrix shape). :func:`hook_initial_q`
    redraws those same values here, and they are loaded into grace's compressor through its
    public ``load_state_dict``; every later Q (warm start) is each side's own. A wrong redraw
    would make the comparison fail, not pass.
  * Per-rank errors differ by design (grace: M − P̂ Q_localᵀ; the hook: M − P̂ Q_sumᵀ/W, and
    M − mean(M) for its uncompressed tensors); the test checks that their sums over ranks agree,
    which is why the averaged gradients agree over several steps.
"""

import io
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import run_ranks

import grace_dgc

SHAPES = {"a": (16, 8), "bias": (16,), "conv": (4, 3, 3, 3), "a2": (16, 8), "tiny": (2, 3), "wide": (32, 24)}
CASES = [(1, 3), (2, 3), (4, 2)]  # (matrix_approximation_rank, PowerSGD steps)


def low_rank(shape, rank, rate=2.0):
    """The hook's ``_should_compress`` rule, restated: r, or 0 for a dense tensor."""
    if len(shape) < 2:
        return 0
    n, m = shape[0], int(np.prod(shape[1:]))
    r = min(n, m, rank)
    return r if (n + m) * r * rate < n * m else 0


def gradient(case, rank, step, name):
    seed = zlib.crc32(f"{case}/{rank}/{step}/{name}".encode())
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed))


def hook_initial_q(seed, rank):
    """The hook's first Qs: one seed per bucket from RandomState(seed), randn per compressed
    tensor in order of first-seen matrix shape (``shape_to_tensors``), drawn on the CPU."""
    groups = {}
    for name, shape in SHAPES.items():
        r = low_rank(shape, rank)
        if r:
            groups.setdefault((shape[0], int(np.prod(shape[1:]))), []).append((name, r))
    generator = torch.Generator().manual_seed(int(np.random.RandomState(seed).randint(1_000_000_000)))
    return {
        name: torch.randn(1, m, r, generator=generator)[0] for (_, m), members in groups.items() for name, r in members
    }


class Bucket:
    """The part of ``dist.GradBucket`` that ``powerSGD_hook`` uses (one bucket, index 0)."""

    def __init__(self, grads):
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        sizes = [g.numel() for g in grads]
        self._views = [v.view(g.shape) for v, g in zip(self._buffer.split(sizes), grads)]

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        return self._views


def hook_vs_grace(rank, world_size):
    """Per case and PowerSGD step: the hook's and grace's averaged gradients, the two error
    sums over ranks, grace's bytes, and the other communicators' results."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    names = list(SHAPES)
    out = []
    for case, (r, steps) in enumerate(CASES):
        seed = 100 + case
        state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=r,
            start_powerSGD_iter=2,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            orthogonalization_epsilon=0,
            random_seed=seed,
        )
        for _ in range(2):  # the hook's vanilla-allreduce iterations
            powerSGD_hook(state, Bucket([torch.zeros(SHAPES[n]) for n in names])).wait()
        graces = {
            c: grace_dgc.build("powersgd", "powersgd", c, engine="torch", compress_rank=r)
            for c in ("allreduce", "allgather", "broadcast")
        }
        q0 = hook_initial_q(seed, r)
        for g in graces.values():
            g.compressor.load_state_dict({"q": q0, "draws": {}})
        record = {"steps": []}
        for step in range(steps):
            grads = [gradient(case, rank, step, n) for n in names]
            bucket = Bucket(grads)  # a copy: the hook works in place
            powerSGD_hook(state, bucket).wait()
            results = {c: [g.step(x, n) for x, n in zip(grads, names)] for c, g in graces.items()}
            record["steps"].append({"hook": [v.clone() for v in bucket.gradients()], **results})
        hook_error = state.error_dict[0].clone()
        ours_error = torch.cat([graces["allreduce"].memory.residuals[n].reshape(-1) for n in names])
        dist.all_reduce(hook_error)
        dist.all_reduce(ours_error)
        record.update(
            hook_error_sum=hook_error,
            ours_error_sum=ours_error,
            bytes={c: g.stats()["bytes_sent"] for c, g in graces.items()},
        )
        out.append(record)
    return out


def expected_bytes(rank, steps, header):
    """Per rank and step: P then Q, (n + m)·r fp32 values per matrix; dense tensors whole.
    ``header``: allgather/broadcast also send one int64 size per payload tensor and round."""
    per_step = 0
    for shape in SHAPES.values():
        r = low_rank(shape, rank)
        n, m = (shape[0], int(np.prod(shape[1:]))) if r else (0, 0)
        per_step += (n + m) * r * 4 + 2 * header if r else int(np.prod(shape)) * 4 + header
    return steps * per_step


@pytest.mark.parametrize("world_size", [1, 2])
def test_matches_pytorch_powersgd_hook(world_size):
    per_rank = run_ranks(hook_vs_grace, world_size)
    for case, (r, steps) in enumerate(CASES):
        records = [ranks[case] for ranks in per_rank]
        for step in range(steps):
            hook = records[0]["steps"][step]["hook"]
            for rec in records:  # every rank holds the same average
                for comm in ("hook", "allreduce", "allgather", "broadcast"):
                    for mine, first in zip(rec["steps"][step][comm], records[0]["steps"][step][comm]):
                        torch.testing.assert_close(mine, first, rtol=1e-5, atol=1e-6)
            for comm in ("allreduce", "allgather", "broadcast"):
                for name, ours, theirs in zip(SHAPES, records[0]["steps"][step][comm], hook):
                    torch.testing.assert_close(
                        ours, theirs, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r}, step {step}, {comm}, {name}: {m}"
                    )
        # what the errors sum to over ranks is the same: the only part that reaches the aggregate
        torch.testing.assert_close(records[0]["ours_error_sum"], records[0]["hook_error_sum"], rtol=1e-4, atol=1e-5)
        assert records[0]["bytes"]["allreduce"] == expected_bytes(r, steps, header=0)
        assert records[0]["bytes"]["allgather"] == expected_bytes(r, steps, header=8)
        # broadcast: a rank sends the size header and, as root, its own buffer
        assert records[0]["bytes"]["broadcast"] == expected_bytes(r, steps, header=8)


# -- an independent float64 reference of the algorithm ---------------------------------------


def gram_schmidt(a):
    a = a.copy()
    for i in range(a.shape[1]):
        a[:, i] /= np.linalg.norm(a[:, i])
        for j in range(i + 1, a.shape[1]):
            a[:, j] -= (a[:, i] @ a[:, j]) * a[:, i]
    return a


def reference_powersgd(grads, q0):
    """Vogels et al., Algorithm 2 on one worker: returns the decompressed gradient per step."""
    error, q, outs = np.zeros_like(grads[0]), q0, []
    for g in grads:
        m = (g + error).reshape(g.shape[0], -1)
        p_hat = gram_schmidt(m @ gram_schmidt(q))
        q = m.T @ p_hat
        approx = p_hat @ q.T
        error = (m - approx).reshape(g.shape)
        outs.append(approx.reshape(g.shape))
    return outs


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([(12, 7), (5, 2, 3), (9, 9), (30, 4)]), st.integers(1, 2), st.integers(1, 5), st.integers(0, 2**31)
)
def test_single_rank_matches_numpy_reference(shape, rank, steps, seed):
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(shape) for _ in range(steps)]
    r = min(shape[0], int(np.prod(shape[1:])), rank)
    q0 = rng.standard_normal((int(np.prod(shape[1:])), r))
    grace = grace_dgc.build(
        "powersgd", "powersgd", "allreduce", engine="local", compress_rank=rank, min_compression_rate=0
    )
    grace.compressor.load_state_dict({"q": {"w": torch.from_numpy(q0)}, "draws": {}})
    for ours, expected in zip((grace.step(torch.from_numpy(g), "w") for g in grads), reference_powersgd(grads, q0)):
        np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-9, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 20), st.integers(2, 20), st.integers(1, 3), st.integers(0, 2**31))
def test_matrix_of_rank_r_is_sent_exactly(n, m, rank, seed):
    """One power step from a random Q spans the column space of a rank-r matrix: P̂ P̂ᵀ M = M."""
    gen = torch.Generator().manual_seed(seed)
    r = min(n, m, rank)
    matrix = torch.randn(n, r, generator=gen, dtype=torch.float64) @ torch.randn(
        r, m, generator=gen, dtype=torch.float64
    )
    grace = grace_dgc.build(
        "powersgd", "powersgd", engine="local", compress_rank=rank, min_compression_rate=0, seed=seed % 1000
    )
    torch.testing.assert_close(grace.step(matrix, "w"), matrix, rtol=1e-7, atol=1e-7)
    assert grace.memory.residuals["w"].abs().max() < 1e-7


def test_error_feedback_conserves_gradient_mass():
    grace = grace_dgc.build("powersgd", "powersgd", engine="local", compress_rank=1)
    grads = [torch.randn(10, 6, dtype=torch.float64) for _ in range(6)]
    sent = sum(grace.step(g, "w") for g in grads)
    torch.testing.assert_close(sent + grace.memory.residuals["w"], sum(grads))


# -- dense tensors, wire size, state --------------------------------------------------------


def test_which_tensors_go_dense():
    comp = grace_dgc.build("powersgd", engine="local", compress_rank=2).compressor
    assert comp.low_rank(()) == 0 and comp.low_rank((1000,)) == 0  # 0-d and 1-D
    assert comp.low_rank((3, 4)) == 0  # (3+4)·2·2 = 28 ≥ 12: factors too big
    assert comp.low_rank((10, 10)) == 2  # 80 < 100
    assert comp.low_rank((8, 1, 1)) == 0 and comp.low_rank((64, 3, 1, 1)) == 0  # m = 1, 3
    bias = torch.randn(7)
    grace = grace_dgc.build("powersgd", "powersgd", engine="local")
    assert torch.equal(grace.step(bias, "b"), bias)
    assert grace.stats()["bytes_sent"] == 7 * 4 and not grace.memory.residuals["b"].any()


def test_bytes_on_the_wire_are_n_plus_m_times_r():
    grace = grace_dgc.build("powersgd", "powersgd", engine="local", compress_rank=3)
    for _ in range(4):
        grace.step(torch.randn(64, 32), "w")
        grace.step(torch.randn(16, 8, 3, 3), "conv")
    assert grace.stats()["bytes_sent"] == 4 * ((64 + 32) * 3 * 4 + (16 + 72) * 3 * 4)
    assert grace.stats()["dense_bytes"] == 4 * (64 * 32 + 16 * 72) * 4


def test_zero_gradient_gives_zeros_not_nan():
    grace = grace_dgc.build("powersgd", "powersgd", engine="local", compress_rank=2)
    for _ in range(2):
        assert torch.equal(grace.step(torch.zeros(20, 10), "w"), torch.zeros(20, 10))


def test_seeded_initial_q_leaves_global_rng_alone():
    state = torch.get_rng_state()
    outs = []
    for _ in range(2):  # two "ranks" with the same seed draw the same Q: same result
        grace = grace_dgc.build("powersgd", engine="local", seed=7, min_compression_rate=0)
        outs.append(grace.step(torch.arange(30.0).reshape(5, 6).sin(), "w"))
    assert torch.equal(outs[0], outs[1]) and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("warm_start", [True, False])
def test_state_dict_round_trip_resumes_exactly(warm_start):
    def make(seed):
        return grace_dgc.build(
            "powersgd", "powersgd", engine="local", compress_rank=2, warm_start=warm_start, seed=seed
        )

    grads = [(torch.randn(12, 9), torch.randn(9)) for _ in range(5)]
    a = make(1)
    for w, b in grads[:2]:
        a.step(w, "w"), a.step(b, "b")
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    with pytest.raises(grace_dgc.GraceConfigError, match="powersgd seed: saved 1, this run 2"):
        make(2).load_state_dict(state)  # another seed draws other initial Qs: refused
    b_ = make(1)
    b_.step(torch.randn(12, 9), "w")  # a Q of its own, replaced by the checkpoint's
    b_.load_state_dict(state)
    assert b_.compressor.draws == a.compressor.draws
    assert all(torch.equal(b_.compressor.q[k], a.compressor.q[k]) for k in a.compressor.q)
    for w, b in grads[2:]:
        assert torch.equal(a.step(w, "w"), b_.step(w, "w")) and torch.equal(a.step(b, "b"), b_.step(b, "b"))
    assert (a.compressor.draws["w"] == 1) == warm_start and ("w" in a.compressor.q) == warm_start


@pytest.mark.parametrize(
    "params",
    [
        {"compress_rank": 0},
        {"compress_rank": 1.5},
        {"min_compression_rate": -1},
        {"warm_start": "yes"},
        {"orthogonalization_epsilon": -1e-8},
        {"seed": -1},
    ],
)
def test_bad_parameters_are_refused(params):
    with pytest.raises(grace_dgc.GraceConfigError, match=next(iter(params))):
        grace_dgc.build("powersgd", engine="local", **params)


def test_seam_refuses_more_rounds_than_declared():
    class Endless(grace_dgc.Compressor):
        summable, rounds = True, 2

        def compress(self, tensor, name):
            return [tensor], None

        def next_round(self, summed, ctx):
            return [summed[0]], None

    grace = grace_dgc.build("none", engine="local")
    grace.compressor = Endless()
    with pytest.raises(RuntimeError, match="rounds=2"):
        grace.step(torch.ones(3), "x")
