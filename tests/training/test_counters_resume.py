"""A resumed run's counters go on from the checkpoint's (issue 53: steps and bytes restarted at
0 after a load, so a resumed run's logs and report no longer added up). One promise, every way
in: Grace.state_dict carries the counters, and each wrapper's state carries its own (the
schedules' steps and syncs, the Adam schedules' warm-up exchanges). The trainers are checked in
their own tests (tests/trainer_checks.py: the resumed run ends at the uninterrupted run's counts)."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc import schedules

COUNTED = ("steps", "groups", "tensors", "bytes_sent", "bytes_received", "dense_bytes")


def model_and_batches(steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    data = torch.Generator().manual_seed(1)
    return model, [torch.randn(4, 6, generator=data) for _ in range(steps)]


def counted(stats):
    return {key: stats[key] for key in COUNTED if key in stats} | {
        key: stats[key] for key in ("syncs",) if key in stats
    }


def wrapped(name, model, engine="local"):
    """(the optimizer a loop steps, whatever holds the state) for one way in."""
    if name == "optimizer":
        grace = grace_dgc.build("topk", "residual", "allgather", engine=engine, compress_ratio=0.3)
        opt = grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters()
        )
        return opt, opt
    if name in ("diloco", "streaming_diloco"):
        grace = grace_dgc.build("topk", "residual", "allgather", engine=engine, compress_ratio=0.3)
        sched = schedules.create(
            name,
            torch.optim.SGD(model.parameters(), lr=0.1),
            grace,
            model.named_parameters(),
            inner_steps=2,
            **({"fragments": 2} if name == "streaming_diloco" else {}),
        )
        return sched, sched
    grace = grace_dgc.build("onebit", "residual", "allgather", engine=engine)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = schedules.create(name, adam, grace, model.named_parameters(), freeze_step=2)
    return sched, sched


def run(name, batches, opt, start=0, stop=None):
    model = opt.model_ref
    for x in batches[start:stop]:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("name", ["optimizer", "diloco", "streaming_diloco", "onebit_adam"])
def test_a_resumed_run_counts_on_from_the_checkpoint(name):
    model, batches = model_and_batches()
    whole, _ = wrapped(name, model)
    whole.model_ref = model
    run(name, batches, whole)
    expected = counted(whole.stats() if hasattr(whole, "stats") else whole.grace.stats())

    model, _ = model_and_batches()
    first, holder = wrapped(name, model)
    first.model_ref = model
    run(name, batches, first, stop=3)
    state = holder.state_dict()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}

    model, _ = model_and_batches()
    model.load_state_dict(saved_model)
    resumed, holder = wrapped(name, model)
    resumed.model_ref = model
    holder.load_state_dict(state)
    run(name, batches, resumed, start=3)
    got = counted(resumed.stats() if hasattr(resumed, "stats") else resumed.grace.stats())
    assert got == expected and got["steps"] == len(batches)


def ddp_hook_job(rank, world):
    model, batches = model_and_batches()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state, hook = grace_dgc.ddp_comm_hook(grace_dgc.build("qsgd", "residual", "allgather"), ddp)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in batches[:3]:
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    before, saved = counted(state.grace.stats()), state.state_dict()
    other = torch.nn.parallel.DistributedDataParallel(model_and_batches()[0])
    again, hook = grace_dgc.ddp_comm_hook(grace_dgc.build("qsgd", "residual", "allgather"), other)
    again.load_state_dict(saved)
    return before, counted(again.grace.stats())


def test_the_ddp_hooks_state_carries_the_counters():
    for before, after in run_ranks(ddp_hook_job, 2):
        assert after == before and before["steps"] == 3 and before["bytes_sent"] > 0
