"""Ranks that train different models are caught, and a resume that forgot grace's state is
named (issue 39): at the first exchange the ranks compare a fingerprint of every parameter;
a resume that restored the optimizer but not grace's per-rank state warns once."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import run_ranks

import grace_dgc
from grace_dgc.handshake import fingerprint


def model_for(rank, seeded_by_rank):
    torch.manual_seed(rank if seeded_by_rank else 0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def one_step(model, opt, rank, step=0):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + rank))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def seeded_job(rank, world, path, seeded_by_rank, broadcast):
    """One step with ranks seeded alike or by rank, through DistributedOptimizer or the DDP
    hook; returns the error text (None: it trained)."""
    model = model_for(rank, seeded_by_rank)
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
    if broadcast:
        grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)
    try:
        if path == "optimizer":
            opt = grace_dgc.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters()
            )
            one_step(model, opt, rank)
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            ddp.register_comm_hook(*grace_dgc.ddp_comm_hook(grace, ddp))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            one_step(ddp, opt, rank)
    except grace_dgc.GraceConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_seeded_differently_are_a_named_error_with_the_fix(world):
    for message in run_ranks(seeded_job, world, ("optimizer", True, False), timeout=120):
        assert message is not None and "the ranks train different models" in message, message
        assert "0.weight" in message and "2.bias" in message and "broadcast_parameters" in message, message


@pytest.mark.parametrize(
    "path, seeded_by_rank, broadcast",
    [("optimizer", False, False), ("optimizer", True, True), ("hook", True, False), ("hook", False, False)],
    ids=["optimizer, seeded alike", "optimizer, broadcast", "hook, seeded by rank (DDP broadcasts)", "hook, alike"],
)
def test_ranks_that_start_alike_train_without_a_word(path, seeded_by_rank, broadcast):
    assert run_ranks(seeded_job, 2, (path, seeded_by_rank, broadcast), timeout=120) == [None, None]


def resume_job(rank, world, how):
    """3 steps, a checkpoint, then a fresh resume restoring it ``how``; returns the warnings
    of the first resumed step."""

    def make():
        model = model_for(0, False)
        grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, grace_dgc.DistributedOptimizer(opt, grace, model.named_parameters())

    model, opt = make()
    for step in range(3):
        one_step(model, opt, rank, step)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "wrapped": opt.optimizer.state_dict(), "all": opt.state_dict()}, saved)
    fresh, fresh_opt = make()
    checkpoint = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    fresh.load_state_dict(checkpoint["model"])
    if how == "optimizer only":  # nanoGPT's resume: the model and the optimizer, not grace
        fresh_opt.optimizer.load_state_dict(checkpoint["wrapped"])
    elif how == "rank 0's state everywhere":
        rank0 = [checkpoint["all"] if rank == 0 else None]
        torch.distributed.broadcast_object_list(rank0, src=0)
        fresh_opt.load_state_dict(rank0[0])
    elif how == "every rank its own":
        fresh_opt.load_state_dict(checkpoint["all"])
    elif how == "fresh run":
        fresh, fresh_opt = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_step(fresh, fresh_opt, rank, 3)
        one_step(fresh, fresh_opt, rank, 4)
    return [str(w.message) for w in caught if "grace" in str(w.message)]


@pytest.mark.parametrize(
    "how, expected",
    [
        ("optimizer only", "grace's state starts empty"),
        ("rank 0's state everywhere", "resumed from rank 0's grace state"),
        ("every rank its own", None),
        ("fresh run", None),
    ],
)
def test_a_resume_that_forgot_grace_state_warns_once_and_a_correct_one_stays_silent(how, expected):
    for rank, caught in enumerate(run_ranks(resume_job, 2, (how,), timeout=120)):
        if expected is None or (how == "rank 0's state everywhere" and rank == 0):
            assert caught == [], (rank, caught)
        else:
            assert len(caught) == 1 and expected in caught[0], (rank, caught)
            assert "gather_state" in caught[0] and "PerRankState" in caught[0]


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=16), min_size=1, max_size=64),
    dtype=st.sampled_from(DTYPES),
    permutation_seed=st.integers(0, 1000),
)
def test_the_fingerprint_is_equal_for_equal_values_in_any_order_and_layout(values, dtype, permutation_seed):
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    order = torch.randperm(tensor.numel(), generator=torch.Generator().manual_seed(permutation_seed))
    assert fingerprint(tensor) == fingerprint(tensor[order])  # an integer sum: any order of additions
    spaced = torch.zeros(2 * tensor.numel(), dtype=dtype)
    spaced[::2] = tensor
    assert fingerprint(spaced[::2]) == fingerprint(tensor)
    changed = tensor.clone()
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    changed.view(as_int)[0] += 1  # one element one representable step away
    assert fingerprint(changed) != fingerprint(tensor)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3 * 64 + 5),
    st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int8]),
    st.integers(0, 2**31),
)
def test_a_fingerprint_summed_in_pieces_is_the_whole_sum(numel, dtype, seed):
    """Large tensors are fingerprinted in pieces (an int64 sum copies what it sums): the same
    number as one sum of the bit patterns, computed here with numpy's wrapping int64 sum."""
    import numpy as np

    import grace_dgc.handshake as handshake

    values = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e3).to(dtype)
    bits = values.numpy().view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[values.element_size()])
    expected = int(bits.astype(np.int64).sum(dtype=np.int64))
    saved, handshake.FINGERPRINT_CHUNK = handshake.FINGERPRINT_CHUNK, 64  # pieces of 64: up to 4 here
    try:
        assert int(fingerprint(values)) == expected
        assert int(fingerprint(values.view(-1, 1).expand(numel, 2)[:, 0])) == expected  # strided
    finally:
        handshake.FINGERPRINT_CHUNK = saved
