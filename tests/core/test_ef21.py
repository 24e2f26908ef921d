"""EF21 and EF21-SGDM (issue 23): the memories against a reference loop written here, on one
rank and on 2 and 3 gloo ranks (every rank bitwise alike), exact resume, bad settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import run_ranks

import grace_dgc
from grace_dgc.errors import GraceConfigError

SHAPES = {"w": (6, 5), "b": (7,)}


def top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """C(x): the k entries of largest magnitude, the rest 0 (written without grace_dgc)."""
    flat = x.reshape(-1)
    kept = torch.zeros_like(flat)
    order = sorted(range(flat.numel()), key=lambda i: -abs(float(flat[i])))[:k]
    for i in order:
        kept[i] = flat[i]
    return kept.view(x.shape)


def reference_ef21(grads_per_rank, ratio, eta=1.0):
    """grads_per_rank[r][t][name] -> the g every rank steps with at each t (Algorithm 1 of
    EF21 / EF21-SGDM, one plain loop over ranks)."""
    world, steps = len(grads_per_rank), len(grads_per_rank[0])
    estimates = [dict() for _ in range(world)]
    momenta = [dict() for _ in range(world)]
    shared, out = {}, []
    for t in range(steps):
        step = {}
        for name in SHAPES:
            changes = []
            for r in range(world):
                grad = grads_per_rank[r][t][name]
                if eta < 1:
                    v = grad.clone() if name not in momenta[r] else (1 - eta) * momenta[r][name] + eta * grad
                    momenta[r][name] = v
                else:
                    v = grad
                g_i = estimates[r].get(name, torch.zeros_like(grad))
                c = top_k(v - g_i, max(1, int(grad.numel() * ratio)))
                estimates[r][name] = g_i + c
                changes.append(c)
            average = sum(changes) / world
            shared[name] = shared.get(name, torch.zeros_like(average)) + average
            step[name] = shared[name].clone()
        out.append(step)
    return out


def gradients(rank, steps, seed=0):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return [{name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()} for _ in range(steps)]


def run(grace, grads):
    return [{name: grace.step(g.clone(), name) for name, g in step.items()} for step in grads]


@pytest.mark.parametrize("memory, eta", [("ef21", 1.0), ("ef21-sgdm", 0.1), ("ef21-sgdm", 0.5)])
def test_one_rank_matches_the_reference_loop(memory, eta):
    grads = gradients(0, 6)
    params = {"eta": eta} if memory == "ef21-sgdm" else {}
    grace = grace_dgc.build("topk", memory, "allgather", engine="local", compress_ratio=0.2, **params)
    got = run(grace, grads)
    expected = reference_ef21([grads], 0.2, eta)
    for t, (g, e) in enumerate(zip(got, expected)):
        for name in SHAPES:
            assert torch.allclose(g[name], e[name], rtol=1e-6, atol=1e-6), (t, name)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 1.0), st.integers(1, 5))
def test_the_estimate_is_every_change_sent_and_the_output_is_the_estimate(seed, ratio, steps):
    """One rank: g_i = Σ_t c_t exactly (nothing is lost or double counted) and the
    optimizer gets g = g_i; with the identity compressor EF21 is the plain gradient."""
    grads = gradients(0, steps, seed)
    grace = grace_dgc.build("topk", "ef21", "allgather", engine="local", compress_ratio=ratio)
    got = run(grace, grads)
    for name in SHAPES:
        assert torch.equal(got[-1][name], grace.memory.estimates[name])
        assert torch.equal(grace.memory.shared[name], grace.memory.estimates[name])
    plain = grace_dgc.build("none", "ef21", "allgather", engine="local")
    for step, out in zip(grads, run(plain, grads)):
        for name in SHAPES:
            assert torch.allclose(out[name], step[name], atol=1e-6)


def ranks_job(rank, world, memory, eta, steps):
    params = {"eta": eta} if memory == "ef21-sgdm" else {}
    grace = grace_dgc.build("topk", memory, "allgather", compress_ratio=0.2, **params)
    return run(grace, gradients(rank, steps))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("memory, eta", [("ef21", 1.0), ("ef21-sgdm", 0.2)])
def test_ranks_step_alike_and_match_the_reference(world, memory, eta):
    steps = 4
    outs = run_ranks(ranks_job, world, (memory, eta, steps))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert all(torch.equal(a[name], b[name]) for name in SHAPES)
    expected = reference_ef21([gradients(r, steps) for r in range(world)], 0.2, eta)
    for t, (g, e) in enumerate(zip(outs[0], expected)):
        for name in SHAPES:
            assert torch.allclose(g[name], e[name], rtol=1e-5, atol=1e-6), (t, name)


@pytest.mark.parametrize("memory", ["ef21", "ef21-sgdm"])
def test_resume_from_a_state_dict_is_bit_for_bit(memory):
    grads = gradients(0, 6)
    whole = grace_dgc.build("topk", memory, "allgather", engine="local", compress_ratio=0.3)
    expected = run(whole, grads)
    first = grace_dgc.build("topk", memory, "allgather", engine="local", compress_ratio=0.3)
    run(first, grads[:3])
    state = first.state_dict()
    first.memory.estimates["w"].add_(1.0)  # the saved state is a copy
    second = grace_dgc.build("topk", memory, "allgather", engine="local", compress_ratio=0.3)
    second.load_state_dict(state)
    for a, b in zip(run(second, grads[3:]), expected[3:]):
        assert all(torch.equal(a[name], b[name]) for name in SHAPES)


@pytest.mark.parametrize("eta", [0, -0.5, 1.5, float("nan")])
def test_eta_outside_the_unit_interval_is_named(eta):
    with pytest.raises(GraceConfigError, match="eta"):
        grace_dgc.build("topk", "ef21-sgdm", "allgather", engine="local", eta=eta)


def test_a_skipped_step_leaves_the_estimates_as_they_were():
    grads = gradients(0, 2)
    grace = grace_dgc.build("topk", "ef21", "allgather", engine="local", compress_ratio=0.3)
    run(grace, grads[:1])
    before = grace.memory.state_dict()
    bad = {name: g.clone() for name, g in grads[1].items()}
    bad["w"][0, 0] = float("nan")
    grace.step(bad["w"], "w")
    after = grace.memory.state_dict()
    for key in ("estimates", "shared"):
        assert torch.equal(after[key]["w"], before[key]["w"])
