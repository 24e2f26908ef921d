"""Chained compressors (issue 43, item 1): ``topk>quantizer`` against a reference written
here, exact bytes, error feedback over the whole composition, the stages' settings and state,
ranks bitwise alike on 2 gloo ranks, refusals by name."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import run_ranks

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS


def top_k(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and indices of the k = ⌊ratio·n⌋ (at least 1) largest magnitudes, by a sort."""
    flat = x.reshape(-1)
    k = max(1, int(flat.numel() * ratio))
    order = torch.argsort(flat.abs(), descending=True, stable=True)[:k]
    return flat[order], order


def scaled_sign(values: torch.Tensor) -> torch.Tensor:
    """EF-SignSGD's C: mean |v| times the sign (0 counts as +)."""
    scale = values.abs().sum(dtype=torch.float32) / values.numel()
    return torch.where(values >= 0, scale, -scale)


def reference(x: torch.Tensor, ratio: float) -> torch.Tensor:
    values, indices = top_k(x, ratio)
    out = torch.zeros(x.numel())
    out[indices] = scaled_sign(values)
    return out.view(x.shape)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 300), st.sampled_from([0.01, 0.1, 0.3]))
def test_topk_then_scaled_sign_is_the_composition_and_its_bytes_are_exact(seed, n, ratio):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    grace = grace_dgc.build("topk>efsignsgd", "none", "allgather", engine="local", compress_ratio=ratio)
    comp = grace.compressor
    payload, ctx = comp.compress(x, "w")
    k = max(1, int(n * ratio))
    assert sorted(t.numel() * t.element_size() for t in payload) == sorted([math.ceil(k / 8), 4, 4 * k])
    # the same support and signs exactly; the scale to fp32 rounding (a sum of the kept values,
    # which the selection and the sort hand over in different orders)
    expected = reference(x, ratio)
    for got in (comp.decompress(payload, ctx), grace.step(x.clone(), "w")):
        assert torch.equal(torch.sign(got), torch.sign(expected))
        assert torch.allclose(got, expected, rtol=1e-6, atol=0)


def test_error_feedback_covers_the_whole_composition():
    """Σ sent + residual = Σ g: what neither the selection nor the quantizer sent is kept."""
    grace = grace_dgc.build("topk>twobit", "residual", "allgather", engine="local", compress_ratio=0.2, threshold=0.5)
    gen = torch.Generator().manual_seed(0)
    total, sent = torch.zeros(50), torch.zeros(50)
    for _ in range(6):
        g = torch.randn(50, generator=gen)
        total += g
        sent += grace.step(g, "w")
    assert torch.allclose(sent + grace.memory.residuals["w"], total, atol=1e-5)
    assert grace.compressor.biased and not grace.compressor.summable


def test_an_unbiased_quantizer_keeps_the_selection_in_expectation():
    """E over QSGD's draws of D(C(x)) = top-k(x): the chain is biased only by its selection."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    values, indices = top_k(x, 0.25)
    expected = torch.zeros(64)
    expected[indices] = values
    draws = 4000
    comp = grace_dgc.build("topk>qsgd", "none", "allgather", engine="local", compress_ratio=0.25, quantum_num=3)
    mean = sum(comp.compressor.decompress(*comp.compressor.compress(x, "w")) for _ in range(draws)) / draws
    assert torch.allclose(mean, expected, atol=0.05)  # ~5 standard errors of the mean at this size
    assert torch.count_nonzero(mean[expected == 0]) == 0


def test_names_parameters_settings_and_state():
    assert COMPRESSORS.canonical("TopK > 2bit") == "topk>twobit"
    assert COMPRESSORS.accepted_params("topk>qsgd") == ["compress_ratio", "quantum_num", "bucket_size", "seed"]
    grace = grace_dgc.build("topk>qsgd", "residual", "allgather", engine="local", compress_ratio=0.5, quantum_num=7)
    assert repr(grace).startswith("Grace(compressor='topk>qsgd'")
    stages = grace.settings()["compressor"]
    assert stages["name"] == "topk>qsgd" and "quantum_num" in stages["settings"]["stages"]
    grace.step(torch.randn(10), "w")
    state = grace.state_dict()
    assert state["methods"]["compressor"] == "topk>qsgd"
    twin = grace_dgc.build("topk>qsgd", "residual", "allgather", engine="local", compress_ratio=0.5, quantum_num=7)
    twin.load_state_dict(state)
    x = torch.randn(10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(grace.step(x.clone(), "w"), twin.step(x.clone(), "w"))  # the stream carried over
    other = grace_dgc.build("topk>qsgd", "residual", "allgather", engine="local", compress_ratio=0.5, quantum_num=3)
    with pytest.raises(GraceConfigError, match="quantum_num"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    "name, why",
    [
        ("qsgd>topk", "not a selection of a fixed count"),
        ("dgc>qsgd", "not a selection of a fixed count"),
        ("topk>thc", "exchanges with the other ranks"),
        ("topk>signsgd", "quantizer of packed codes that averages"),
        ("topk>fp16", "quantizer of packed codes that averages"),
        ("topk>qsgd>twobit", "two stages"),
    ],
)
def test_what_cannot_be_chained_is_refused_by_name(name, why):
    with pytest.raises(GraceConfigError, match=why):
        grace_dgc.build(name, "residual", "allgather", engine="local")


def test_a_chain_needs_a_communicator_that_moves_whole_payloads():
    with pytest.raises(GraceConfigError, match="cannot be summed"):
        grace_dgc.build("topk>qsgd", "residual", "allreduce", engine="local")
    with pytest.raises(GraceConfigError, match="unknown parameter"):
        COMPRESSORS.get("topk>qsgd")(threshold=0.1)


def ranks_job(rank: int, world: int) -> list:
    grace = grace_dgc.build("topk>qsgd", "residual", "allgather", compress_ratio=0.1, quantum_num=3, seed=5)
    gen = torch.Generator().manual_seed(rank)
    return [grace.step(torch.randn(200, generator=gen), "w") for _ in range(3)]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_bitwise(world):
    outs = run_ranks(ranks_job, world)
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))
    assert all(torch.count_nonzero(o) <= 20 * world for o in outs[0])  # at most k per rank survives
