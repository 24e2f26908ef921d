"""Resume the way users do (issue 38), bit for bit against the run that was never stopped.

A user's resume: ``state_dict()`` → ``torch.save`` → ``torch.load(weights_only=True)`` →
a fresh model, optimizer and Grace built anew → ``load_state_dict`` → train on. Earlier
tests restored into the same objects and missed that the shape check refused PowerSGD's Q
(m × r, not the parameter's shape) and reduce_scatter's owner chunks. Here, on 2 and 3
gloo ranks, fused (one bucket) and unfused (one per parameter):

* every compressor × memory pair that ``build`` accepts, over allgather;
* every communicator (hierarchical × every outer, auto after each of its choices, both
  settings of sparse_allreduce and reduce_scatter) × every compressor it accepts;
* the owner-state cases again through ``gather_state``/``load_gathered_state`` (a rank-0
  file) and through ``PerRankState`` with torch.distributed.checkpoint.

Each case trains 3 steps, saves, trains 3 more; a fresh set of objects loads the save and
trains the same 3 steps. The parameters and every rank's grace state must be equal bit for
bit, and a model of another shape must still be refused.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from conftest import without_timings
from method_params import PARAMS
from ranks import run_ranks
from test_state import same
from test_state import train_steps as train

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS, MEMORIES

AUTO_LINK = {"bandwidth": 1e9, "latency": 1e-5}
AUTO_CHOICES = ("allreduce", "allgather", "sparse_allreduce", "reduce_scatter")


def case(compressor, memory, communicator, plan=None, **params):
    return {"compressor": compressor, "memory": memory, "communicator": communicator, "params": params, "plan": plan}


def label(c):
    extra = ",".join(f"{k}={v}" for k, v in c["params"].items() if k not in AUTO_LINK)
    plan = f" (auto chose {c['plan']})" if c["plan"] else ""
    return f"{c['compressor']}+{c['memory']} over {c['communicator']}({extra}){plan}"


def pair_cases():
    """Every compressor × memory pair, over allgather (build refuses the pairs that do not fit)."""
    return [
        case(comp, mem, "allgather", **PARAMS.get(comp, {})) for comp in COMPRESSORS.names() for mem in MEMORIES.names()
    ]


def communicator_cases(world):
    """Every communicator setting × every compressor it accepts, with the residual memory
    (PowerSGD with its own); hierarchical with 2 nodes on 2 ranks and 1 node of 3 on 3."""
    group = 1 if world == 2 else world
    settings = [
        ("allreduce", {}),
        ("allgather", {}),
        ("broadcast", {}),
        ("sparse_allreduce", {"global_topk": False}),
        ("sparse_allreduce", {"global_topk": True}),
        ("reduce_scatter", {"error_feedback": True}),
        ("reduce_scatter", {"error_feedback": False}),
    ]
    settings += [
        ("hierarchical", {"outer": outer, "group_size": group})
        for outer in ("allgather", "allreduce", "broadcast", "reduce_scatter", "sparse_allreduce", "auto")
    ]
    cases = []
    for comp in COMPRESSORS.names():
        instance = COMPRESSORS.get(comp)(**PARAMS.get(comp, {}))
        memory = "powersgd" if comp == "powersgd" else "residual"
        for comm, params in settings:
            outer = params.get("outer", comm)
            if not COMMUNICATORS.get(comm).fits(instance) or not COMMUNICATORS.get(outer).fits(instance):
                continue  # (hierarchical: no multi-round methods between nodes)
            plans = [None]
            if outer == "auto":
                plans = [c for c in AUTO_CHOICES if COMMUNICATORS.get(c).fits(instance)]
            cases += [case(comp, memory, comm, plan, **PARAMS.get(comp, {}), **params) for plan in plans]
        if COMMUNICATORS.get("auto").fits(instance):
            choices = [c for c in AUTO_CHOICES if COMMUNICATORS.get(c).fits(instance)]
            cases += [case(comp, memory, "auto", c, **PARAMS.get(comp, {}), **AUTO_LINK) for c in choices]
    return cases


OWNER_STATE = [
    case("qsgd", "residual", "reduce_scatter"),
    case("powersgd", "powersgd", "allreduce"),
    case("powersgd", "residual", "allgather"),
    case("qsgd", "residual", "hierarchical", outer="reduce_scatter", group_size=1),
    case("qsgd", "residual", "hierarchical", plan="reduce_scatter", outer="auto", group_size=1),
    case("qsgd", "residual", "auto", plan="reduce_scatter", **AUTO_LINK),
    case("topk", "momentum", "sparse_allreduce", compress_ratio=0.3),
]


def make(c, fusion_bytes, width=16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 5))
    # the default group: hundreds of cases, and a group of its own per Grace (tests/training/test_own_group.py)
    # would cost a rendezvous each
    group = torch.distributed.group.WORLD
    grace = grace_dgc.build(c["compressor"], c["memory"], c["communicator"], process_group=group, **c["params"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = model.named_parameters()
    return model, grace_dgc.DistributedOptimizer(optimizer, grace, named, fusion_bytes=fusion_bytes)


def force_plan(opt, choice):
    """auto's choice for every bucket from now on (its own is timed, so two runs could
    differ); under hierarchical every rank of a node sets the same plan."""
    auto = opt.grace.communicator
    auto = getattr(auto, "outer", auto)
    for name in opt._names.values():
        auto.choice[name] = choice
    for bucket in auto.buckets.values():
        bucket["chosen"] = choice


def comparable(state):
    """The grace state without auto's measured seconds (its choices stay) and without the
    counters' seconds (the counts stay: a resumed run's must add up to the uninterrupted one's)."""
    state = dict(without_timings(state))
    comm = state.get("communicator", {})
    if isinstance(comm, dict) and "outer" in comm and isinstance(comm["outer"], dict):
        comm = dict(comm, outer=comparable({"communicator": comm["outer"]})["communicator"])
    if isinstance(comm, dict) and "buckets" in comm:
        comm = dict(comm, buckets={k: v["chosen"] for k, v in comm["buckets"].items()})
    state["communicator"] = comm
    return state


def save_and_load(how, model, opt, c, fusion_bytes, path):
    """Save ``model``/``opt`` as a user of ``how`` does; build fresh objects and resume them."""
    rank = torch.distributed.get_rank()
    if how == "state_dict":  # every rank its own file (here: bytes)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
        fresh, fresh_opt = make(c, fusion_bytes)
        checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        fresh.load_state_dict(checkpoint["model"])
        fresh_opt.load_state_dict(checkpoint["optimizer"])
    elif how == "gather_state":  # one file, written by rank 0 (its optimizer state carries its own grace state)
        gathered = grace_dgc.gather_state(opt)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "grace": gathered}, path)
        torch.distributed.barrier()
        fresh, fresh_opt = make(c, fusion_bytes)
        checkpoint = torch.load(path, weights_only=True)
        fresh.load_state_dict(checkpoint["model"])
        fresh_opt.load_state_dict(checkpoint["optimizer"])
        grace_dgc.load_gathered_state(fresh_opt, checkpoint["grace"])
    else:  # torch.distributed.checkpoint
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, opt.optimizer)
        dcp.save({"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(opt)}, checkpoint_id=path)
        fresh, fresh_opt = make(c, fusion_bytes)
        model_state, optim_state = get_state_dict(fresh, fresh_opt.optimizer)
        state = {"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(fresh_opt)}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return fresh, fresh_opt


def resume_job(rank, world, cases, fusion_bytes, how="state_dict", directory=None):
    """Each case as the module docstring says. Returns (cases run, problems)."""
    ran, problems = 0, []
    for i, c in enumerate(cases):
        try:
            model, opt = make(c, fusion_bytes)
        except GraceConfigError:
            continue  # a pair build refuses (on every rank alike)
        try:
            train(model, opt, range(3), rank)
            if c["plan"]:
                force_plan(opt, c["plan"])
            path = os.path.join(directory, f"case{i}") if directory else None
            fresh, fresh_opt = save_and_load(how, model, opt, c, fusion_bytes, path)
            train(model, opt, range(3, 6), rank)
            train(fresh, fresh_opt, range(3, 6), rank)
        except Exception as error:  # stop: the ranks' collectives may be out of step now
            problems.append(f"{label(c)}: {type(error).__name__}: {str(error)[:400]}")
            break
        ran += 1
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            if not torch.equal(p, q):
                problems.append(f"{label(c)}: {name} differs after the resumed steps")
        if not same(comparable(opt.grace.state_dict()), comparable(fresh_opt.grace.state_dict())):
            problems.append(f"{label(c)}: the grace state differs after the resumed steps")
        opt.grace.close()  # its thread and its own process group: hundreds of cases share these ranks
        fresh_opt.grace.close()
    return ran, problems


# every pair on 2 ranks unfused (a bucket per parameter) and on 3 ranks (uneven chunks) fused, as the
# communicators below: 3 ranks unfused adds nothing a pair could differ in and took 2 minutes of CI, and
# 2 ranks fused (24 s) only crossed the two (fusion's groups are the same on 2 ranks and on 3)
@pytest.mark.parametrize("world, fusion_bytes", [(2, 0), (3, 1 << 20)], ids=["2-unfused", "3-fused"])
def test_every_compressor_memory_pair_resumes_bit_for_bit(world, fusion_bytes):
    results = run_ranks(resume_job, world, (pair_cases(), fusion_bytes), timeout=600)
    for rank, (ran, problems) in enumerate(results):
        assert not problems, f"rank {rank}: {problems}"
        assert ran >= 60, f"only {ran} of {len(MEMORIES.names()) * len(COMPRESSORS.names())} pairs were built"


# every communicator on 2 ranks unfused (a bucket per parameter: several buckets' state) and on
# 3 ranks fused (uneven owner chunks of a 229-element bucket); 3 ranks unfused crossed the two
# (each parameter's own uneven chunks) and took 76 s of the suite's 15 minutes; every
# communicator's exchange of groups of 1–3 tensors of any size on 3 ranks is
# tests/core/test_exchange_property.py's
@pytest.mark.parametrize("world, fusion_bytes", [(2, 0), (3, 1 << 20)], ids=["2-unfused", "3-fused"])
def test_every_communicator_resumes_bit_for_bit(world, fusion_bytes):
    cases = communicator_cases(world)
    results = run_ranks(resume_job, world, (cases, fusion_bytes), timeout=600)
    for rank, (ran, problems) in enumerate(results):
        assert not problems, f"rank {rank}: {problems}"
        assert ran == len(cases), f"rank {rank}: {ran} of {len(cases)} cases were built"


@pytest.mark.parametrize("how", ["gather_state", "dcp"])
@pytest.mark.parametrize("world", [2, 3])
def test_owner_state_resumes_through_a_rank_0_file_and_dcp(world, how, tmp_path):
    results = run_ranks(resume_job, world, (OWNER_STATE, 0, how, str(tmp_path)), timeout=600)
    for rank, (ran, problems) in enumerate(results):
        assert not problems, f"rank {rank}: {problems}"
        assert ran == len(OWNER_STATE)


def refusal_job(rank, world):
    """A checkpoint of a 16-wide model loaded into a 12-wide one, per owner-state case."""
    messages = []
    for c in OWNER_STATE:
        model, opt = make(c, 0)
        train(model, opt, range(2), rank)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        _, other = make(c, 0, width=12)
        try:
            other.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        except GraceConfigError as error:
            messages.append(str(error))
        else:
            messages.append(f"{label(c)}: loaded")
    return messages


def test_a_differently_shaped_model_is_still_refused_by_name():
    for messages in run_ranks(refusal_job, 2, timeout=300):
        for message in messages:
            assert "this checkpoint is of a differently shaped model" in message, message
