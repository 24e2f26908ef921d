"""grace's traffic never meets the user's (issue 53): a Grace built without ``process_group``
exchanges over a group of its own, so a training loop's own collectives on the default group
(a logged loss's all_reduce each step, one issued while exchanges are still in flight) and a
second Grace built while the first has an exchange in flight neither hang nor abort, on every
way in: the DistributedOptimizer, the DDP hook, the outer-loop schedules (DiLoCo, Streaming
DiLoCo at delay 1 and 2, SparseLoCo) and the Adam schedules. 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc import schedules

STEPS = 6


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3))


def way_in(name, model):
    """(the optimizer to step, the model to run forward) for one way in, over a default-built Grace."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    if name == "optimizer":
        grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
        return grace_dgc.DistributedOptimizer(sgd, grace, model.named_parameters(), fusion_bytes=0), model
    if name == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
        ddp.register_comm_hook(*grace_dgc.ddp_comm_hook(grace_dgc.build("qsgd", "residual", "allgather"), ddp))
        return sgd, ddp
    if name.startswith("streaming"):
        grace = grace_dgc.streaming_grace()
        delay = int(name[-1])
        schedule = schedules.create(
            "streaming_diloco", sgd, grace, model.named_parameters(), inner_steps=4, fragments=2, delay=delay
        )
        return schedule, model
    if name in ("diloco", "sparseloco"):
        grace = grace_dgc.sparseloco_grace() if name == "sparseloco" else grace_dgc.build("none")
        return schedules.create(name, sgd, grace, model.named_parameters(), inner_steps=2), model
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    grace = grace_dgc.build("onebit", "residual", "allgather")
    params = {"freeze_step": 2} if name == "onebit_adam" else {"var_freeze_step": 2}
    return schedules.create(name, adam, grace, model.named_parameters(), **params), model


def beside_users_collectives_job(rank, world, name):
    import torch.distributed as dist

    model = make_model()
    optimizer, forward = way_in(name, model)
    data = torch.Generator().manual_seed(rank)
    logged = []
    for step in range(STEPS):
        x, y = torch.randn(6, 8, generator=data), torch.randint(0, 3, (6,), generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        # the user's own collective while grace's exchanges of this step may still be in flight
        total = loss.detach().clone()
        dist.all_reduce(total)
        optimizer.step()
        # and between steps, as a training loop logs (Streaming DiLoCo's fragment is in flight here)
        dist.all_reduce(total)
        logged.append(float(total))
        if step == 2:  # a second Grace built, and its handshake run, while the first has exchanges in flight
            other = grace_dgc.build("fp16", "none", "allreduce")
            other.step(torch.ones(4), "other")
            other.close()
    return logged


WAYS_IN = ["optimizer", "ddp", "streaming1", "streaming2", "diloco", "sparseloco", "onebit_adam", "zero_one_adam"]


@pytest.mark.parametrize("name", WAYS_IN)
def test_the_users_collectives_and_a_second_grace_run_beside_grace_on_every_way_in(name):
    logged = run_ranks(beside_users_collectives_job, 2, (name,), timeout=120)
    assert logged[0] == logged[1] and len(logged[0]) == STEPS  # the ranks' own all_reduce agreed every step


def group_job(rank, world):
    import torch.distributed as dist

    made = grace_dgc.build("none")
    shared = grace_dgc.build("none", process_group=dist.group.WORLD)
    made.step(torch.ones(2), "w")
    out = {
        "own": made.engine.resolve().group is not dist.group.WORLD and made.engine.resolve().owns_group,
        "shared": shared.engine.resolve().owns_group,
    }
    made.close()
    try:
        made.step(torch.ones(2), "w")
        out["after_close"] = "no error"
    except grace_dgc.GraceCommError as error:
        out["after_close"] = str(error)
    groups = dist.distributed_c10d._world.pg_map
    before = len(groups)  # hierarchical's nodes and leaders, on the default group: released with their Grace
    tiered = grace_dgc.build("none", "none", "hierarchical", group_size=1, process_group=dist.group.WORLD)
    out["tiered"] = tiered.step(torch.full((2,), float(rank)), "w").tolist()
    out["split_groups"] = len(groups) - before
    tiered.close()
    out["left_after_close"] = len(groups) - before
    return out


def test_a_default_grace_owns_its_group_and_close_releases_it_and_its_subgroups():
    for out in run_ranks(group_job, 2):
        assert out["own"] and not out["shared"]
        assert "Grace.close()" in out["after_close"], out["after_close"]
        assert out["tiered"] == [0.5, 0.5] and out["split_groups"] > 0 and out["left_after_close"] == 0, out


def dropped_way_in(name):
    """A way in over a local Grace, trained 4 steps: (model, wrapper, grace)."""
    from grace_dgc.training.schedules import DiLoCo
    from grace_dgc.training.schedules.adam import OneBitAdam, ZeroOneAdam
    from grace_dgc.training.schedules.streaming import StreamingDiLoCo, streaming_grace

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sign = ("efsignsgd", "residual", "reduce_scatter")
    made = {
        "optimizer": lambda: (grace_dgc.DistributedOptimizer, torch.optim.SGD, ("topk", "residual", "allgather"), {}),
        "diloco": lambda: (DiLoCo, torch.optim.SGD, ("none",), {"inner_steps": 2}),
        "streaming": lambda: (StreamingDiLoCo, torch.optim.SGD, None, {"inner_steps": 2, "fragments": 1}),
        "onebit_adam": lambda: (OneBitAdam, torch.optim.Adam, sign, {"freeze_step": 2}),
        "zero_one_adam": lambda: (ZeroOneAdam, torch.optim.Adam, sign, {"var_freeze_step": 2}),
    }
    wrapper_class, optimizer_class, parts, settings = made[name]()
    params = {"compress_ratio": 0.5} if name == "optimizer" else {"scale": "rms"} if parts == sign else {}
    grace = streaming_grace(engine="local") if parts is None else grace_dgc.build(*parts, engine="local", **params)
    wrapper = wrapper_class(optimizer_class(model.parameters(), lr=0.01), grace, model.named_parameters(), **settings)
    for _ in range(4):
        wrapper.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        wrapper.step()
    return model, wrapper, grace


@pytest.mark.parametrize("name", ["optimizer", "diloco", "streaming", "onebit_adam", "zero_one_adam"])
def test_a_dropped_way_in_is_freed_with_its_grace(name):
    """Autograd holds a parameter's hooks where the garbage collector cannot see: a hook bound to
    the DistributedOptimizer kept every dropped wrapper, its Grace and the Grace's process groups
    alive (and its hooks exchanging) for the life of the process. No way in may keep them."""
    import gc
    import weakref

    model, wrapper, grace = dropped_way_in(name)
    alive = [weakref.ref(wrapper), weakref.ref(grace)]
    del wrapper, grace
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    model.zero_grad()
    model(torch.ones(2, 4)).sum().backward()  # a dropped wrapper's hooks do nothing: plain autograd
    assert torch.equal(model.bias.grad, torch.full((3,), 2.0))
