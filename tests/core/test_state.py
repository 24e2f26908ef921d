"""State is never dropped, settings are compared before set-up, and resume is bit-exact
(issue 26), on real gloo process groups of 2-4 ranks."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import without_timings
from ranks import run_ranks

import grace_dgc
from grace_dgc.errors import GraceConfigError

# -- settings that act at set-up are compared before it -------------------------------------


def setup_job(rank, world_size, case):
    """Each rank builds what ``case`` gives it; returns the error text (or None)."""
    import os

    try:
        if case == "auto link given on one rank":
            extra = {"bandwidth": 1e9, "latency": 1e-5} if rank == 0 else {}
            grace = grace_dgc.build("qsgd", "residual", "auto", **extra)
        elif case == "group size":
            grace = grace_dgc.build("qsgd", "residual", "hierarchical", group_size=world_size if rank else 1)
        elif case == "LOCAL_WORLD_SIZE":
            os.environ["LOCAL_WORLD_SIZE"] = "1" if rank == 0 else str(world_size)
            grace = grace_dgc.build("qsgd", "residual", "hierarchical")
        elif case == "bad LOCAL_WORLD_SIZE on one rank":
            os.environ["LOCAL_WORLD_SIZE"] = "abc" if rank == 1 else "1"
            grace = grace_dgc.build("qsgd", "residual", "hierarchical")
        elif case == "hierarchical against allgather":
            comm = "hierarchical" if rank == 0 else "allgather"
            grace = grace_dgc.build("qsgd", "residual", comm, **({"group_size": 1} if rank == 0 else {}))
        grace.step(torch.ones(8), "w")
    except GraceConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "case, named",
    [
        ("auto link given on one rank", r"communicator parameters — rank 0: bandwidth=1000000000.0"),
        ("group size", r"communicator parameters — rank 0: group_size=1, .*rank 1: group_size=3"),
        ("LOCAL_WORLD_SIZE", r"rank 0: group_size=1, .*rank 1: group_size=3"),
        ("bad LOCAL_WORLD_SIZE on one rank", r"rank 1: group_size=\"invalid \(LOCAL_WORLD_SIZE='abc' in the env"),
        ("hierarchical against allgather", r"communicator — rank 0: hierarchical; rank 1: allgather"),
    ],
)
def test_settings_that_act_at_set_up_differ_in_a_named_error_on_every_rank_not_a_hang(case, named):
    import re

    errors = run_ranks(setup_job, 3, (case,), timeout=120)
    for error in errors:
        assert error is not None and "the ranks run different configurations" in error, error
        assert re.search(named, error), error


# -- state is never dropped -----------------------------------------------------------------


def held(grace):
    """What this rank holds back, on the scale of the average: its memory / N plus the
    owner errors it carries (reduce_scatter's, also inside auto)."""
    n, total = grace.world_size, {}
    lr = getattr(grace.memory, "lr", 1.0)  # efsignsgd keeps lr·e
    for name, residual in getattr(grace.memory, "residuals", {}).items():
        total[name] = residual.double().reshape(-1) / lr / n
    comm = grace.communicator
    owners = comm.members["reduce_scatter"] if comm.registered_name == "auto" else comm
    owners = getattr(owners, "outer", None) or owners  # hierarchical: its outer communicator's
    for name, error in getattr(owners, "errors", {}).items():
        flat = total.setdefault(name, torch.zeros(SIZE, dtype=torch.float64)).view(-1)
        bounds = grace.wire.auto.chunked.bounds(SIZE) if comm.registered_name == "auto" else None
        bounds = bounds or [round(i * SIZE / n) for i in range(n + 1)]
        flat[bounds[grace.rank] : bounds[grace.rank + 1]] += error.double()
    return total


SIZE = 60


def switching_job(rank, world_size, dtype_name):
    """qsgd + residual under auto; the plan is switched by hand between reduce_scatter and
    allgather every other step, and one step overflows fp16. Returns per step: applied
    average (or None when skipped), the gradient, and finally what is held."""
    dtype = getattr(torch, dtype_name)
    grace = grace_dgc.build("qsgd", "residual", "auto", bandwidth=1e9, latency=1e-5, quantum_num=4)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step in range(8):
        grace.communicator.choice["w"] = "reduce_scatter" if step % 2 == 0 else "allgather"
        grad = torch.randn(SIZE, generator=gen).to(dtype)
        if step in (4, 5) and dtype == torch.float16:
            grad[3] = 6e4  # finite, but the sum of N of them overflows fp16 (reduce_scatter, then allgather)
        state = held(grace)
        averaged = grace.step(grad, "w")
        skipped = bool(torch.isnan(averaged).any())
        if skipped:
            after = held(grace)
            assert all(torch.equal(state[k], after[k]) for k in state) and state.keys() == after.keys()
        out.append((None if skipped else averaged.double(), grad.double()))
    stranded = sorted(grace.communicator.members["reduce_scatter"].errors)  # the last step went by allgather
    return out, {k: v for k, v in held(grace).items()}, stranded


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_auto_switching_and_skipped_steps_lose_no_gradient_mass(world, dtype):
    results = run_ranks(switching_job, world, (dtype,), timeout=180)
    applied = sum(a for a, _ in results[0][0] if a is not None)
    skipped = [i for i, (a, _) in enumerate(results[0][0]) if a is None]
    assert (dtype == "float16") == bool(skipped)
    sent = sum(g for r in results for i, (_, g) in enumerate(r[0]) if i not in skipped) / world
    kept = sum(r[1].get("w", torch.zeros(SIZE, dtype=torch.float64)) for r in results)
    assert all(r[2] == [] for r in results), "owner errors left behind in reduce_scatter"
    eps = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    assert torch.allclose(applied + kept, sent, rtol=0, atol=eps), (applied + kept - sent).abs().max()


# every communicator with an error-feedback memory (and a compressor it carries)
CONSERVING = [
    ("randomk", "residual", "allreduce", {"compress_ratio": 0.3}),
    ("powersgd", "powersgd", "allreduce", {"compress_rank": 1}),
    ("topk", "residual", "allgather", {"compress_ratio": 0.3}),
    ("efsignsgd", "efsignsgd", "allgather", {"lr": 0.5}),
    ("topk", "residual", "broadcast", {"compress_ratio": 0.3}),
    ("qsgd", "residual", "reduce_scatter", {"quantum_num": 4}),
    ("topk", "residual", "sparse_allreduce", {"compress_ratio": 0.3, "global_topk": True}),
    ("qsgd", "residual", "hierarchical", {"outer": "allgather", "quantum_num": 4}),
    ("natural", "residual", "auto", {"bandwidth": 1e9, "latency": 1e-5}),
]


def conservation_job(rank, world_size, dtype_name):
    """:func:`method_conservation` for every method of CONSERVING, in one process group."""
    return [method_conservation(rank, world_size, method, dtype_name) for method in CONSERVING]


def method_conservation(rank, world_size, method, dtype_name):
    """6 steps of one method (fp16: step 2's gradient is 4e4 everywhere, finite, but the sum
    over the ranks overflows: skipped by the methods that sum values);
    returns per step the applied average (None when skipped) and the gradient, and what the
    rank holds at the end, on the average's scale."""
    comp, mem, comm, params = method
    if comm == "hierarchical":
        params = dict(params, group_size=2 if world_size % 2 == 0 else 1)
    dtype = getattr(torch, dtype_name)
    grace = grace_dgc.build(comp, mem, comm, **params)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step in range(6):
        grad = torch.randn(SIZE // 6, 6, generator=gen).to(dtype)
        if step == 2 and dtype == torch.float16:
            grad.fill_(4e4)
        before = held(grace)
        averaged = grace.step(grad, "w").reshape(-1)
        skipped = bool(torch.isnan(averaged).any())
        if skipped:  # a skipped step leaves what is held bitwise as it was
            after = held(grace)
            assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        out.append((None if skipped else averaged.double(), grad.reshape(-1).double()))
    kept = held(grace).get("w", torch.zeros(SIZE, dtype=torch.float64))
    if comm == "hierarchical":  # the ranks of a node hold the same memory of the node's sum: count it once
        kept = kept / params["group_size"]
    return out, kept


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_error_feedback_loses_no_gradient_mass_over_every_communicator(dtype, world):
    """Issue 26: applied averages + what every rank holds (memory / N, owner errors) = the
    average of the gradients of the steps taken, for every communicator of CONSERVING,
    fp32/fp16/bf16, skipped steps included; a skip does not last (the state it restores is
    whole: PowerSGD's Q too)."""
    per_rank = run_ranks(conservation_job, world, (dtype,), timeout=300)
    failures = []
    for m, (comp, mem, comm, _) in enumerate(CONSERVING):
        results = [ranks[m] for ranks in per_rank]
        steps = results[0][0]
        skipped = [i for i, (a, _) in enumerate(steps) if a is None]
        applied = sum(a for a, _ in steps if a is not None)
        sent = sum(g for r in results for i, (_, g) in enumerate(r[0]) if i not in skipped) / world
        kept = sum(r[1] for r in results)
        eps = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}[dtype] * max(float(sent.abs().max()), 1.0)
        error = float((applied + kept - sent).abs().max())
        if not set(skipped) <= ({2} if dtype == "float16" else set()) or not error <= eps:
            failures.append(f"{comp}+{mem} over {comm}: skipped steps {skipped}, off by {error:.3g} (eps {eps:.3g})")
    assert not failures, failures


# -- resume is bit-exact -------------------------------------------------------------------

RESUMED = [
    ("fp16", "residual", "allreduce", {}),
    ("powersgd", "powersgd", "allreduce", {"compress_rank": 2}),
    ("topk", "residual", "allgather", {"compress_ratio": 0.2}),
    ("dgc", "momentum", "allgather", {"compress_ratio": 0.2, "min_compress_size": 1}),
    ("efsignsgd", "efsignsgd", "allgather", {"lr": 0.1}),
    ("signum", "none", "broadcast", {}),
    ("topk", "residual", "sparse_allreduce", {"compress_ratio": 0.2, "global_topk": True}),
    ("dgc", "momentum", "sparse_allreduce", {"compress_ratio": 0.2, "min_compress_size": 1}),
    ("qsgd", "residual", "reduce_scatter", {"quantum_num": 4}),
    ("terngrad", "none", "reduce_scatter", {}),
    ("qsgd", "residual", "hierarchical", {"outer": "reduce_scatter", "quantum_num": 4}),
    ("topk", "momentum", "hierarchical", {"outer": "sparse_allreduce", "compress_ratio": 0.2}),
    ("qsgd", "residual", "auto", {"quantum_num": 4}),
    ("natural", "residual", "auto", {}),
]
# auto's plan for the steps before the save, set by hand (its own choice is timed): a bucket
# leaves reduce_scatter (its owner errors fold into the next exchange) and comes back, so
# the checkpoint holds owner errors and a plan; the steps after it follow the loaded plan
AUTO_PLAN = ["reduce_scatter", "allgather", "reduce_scatter"]


def resume_job(rank, world_size, device="cpu"):
    """Per method: run 3 steps, save, run 4 more; a fresh Grace loads the saved state
    (weights_only) and runs the same 4 steps. Returns the mismatches. ``device="cuda"``
    (tests/core/test_cuda.py) puts the gradients on the rank's GPU."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    mismatches = []
    for comp, mem, comm, params in RESUMED:
        if comm == "hierarchical":
            params = dict(params, group_size=2 if world_size % 2 == 0 else 1)
        gen = torch.Generator().manual_seed(rank)
        grads = [
            [torch.randn(40, generator=gen).to(device), torch.randn(7, 5, generator=gen).to(device)] for _ in range(7)
        ]

        def run(grace, steps, plan=()):
            out = []
            for i, g in enumerate(steps):
                if i < len(plan):
                    grace.communicator.choice.update(a=plan[i], b=plan[i])
                out.append(grace.step_group_async(g, ["a", "b"]).result())
            return out

        first = grace_dgc.build(comp, mem, comm, **params)
        run(first, grads[:3], AUTO_PLAN if comm == "auto" else ())
        if comm == "auto":
            first.communicator.choice.update(a="reduce_scatter", b="reduce_scatter")
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        expected = run(first, grads[3:])
        resumed = grace_dgc.build(comp, mem, comm, **params)
        resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True, map_location=device))
        got = run(resumed, grads[3:])
        label = f"{comp}+{mem} over {comm}"
        for step, (e, g) in enumerate(zip(expected, got)):
            if not all(torch.equal(x, y) for x, y in zip(e, g)):
                mismatches.append(f"{label}: step {step + 4} differs")
        a, b = without_timings(first.state_dict()), without_timings(resumed.state_dict())
        if comm == "auto":  # each bucket's figures hold measured seconds; the choices must match
            for state in (a, b):
                state["communicator"]["buckets"] = {k: v["chosen"] for k, v in state["communicator"]["buckets"].items()}
        if not same(a, b):
            mismatches.append(f"{label}: the state after the resumed steps differs")
    return mismatches


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("world", [2, 3, 4])
def test_resume_from_a_checkpoint_is_bit_exact_for_every_communicator(world):
    for rank, mismatches in enumerate(run_ranks(resume_job, world, (), timeout=300)):
        assert not mismatches, f"rank {rank}: {mismatches}"


# -- checkpoints the way trainers write them -------------------------------------------------


def small_training(compressor, communicator, **params):
    """A small model and its DistributedOptimizer (SGD with momentum, residual memory)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    grace = grace_dgc.build(compressor, "residual", communicator, **params)
    opt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), grace, model.named_parameters()
    )
    return model, opt


def train_steps(model, opt, steps, rank):
    """One step per entry of ``steps`` on a batch drawn from (step, rank); the parameters after."""
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def rank0_checkpoint_job(rank, world_size, path, shared):
    """A rank-0-only training script: 3 steps, rank 0 saves model, optimizer and every
    rank's grace state in one file; fresh objects on every rank resume from it (reading the
    file on every rank when ``shared``, else only rank 0) and take 3 more steps. Returns the
    mismatches against the uninterrupted run."""

    def make():
        return small_training("topk", "allgather", compress_ratio=0.2)

    def train(model, opt, steps):
        return train_steps(model, opt, steps, rank)

    model, opt = make()
    train(model, opt, range(3))
    gathered = grace_dgc.gather_state(opt)
    assert (gathered is None) == (rank != 0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "grace": gathered}, path)
    torch.distributed.barrier()
    train(model, opt, range(3, 6))

    fresh, fresh_opt = make()
    checkpoint = torch.load(path, weights_only=True) if shared or rank == 0 else None
    if checkpoint is not None:
        fresh.load_state_dict(checkpoint["model"])
        fresh_opt.load_state_dict(checkpoint["optimizer"])  # rank 0's grace state, replaced below
    grace_dgc.broadcast_parameters(fresh.state_dict())
    grace_dgc.broadcast_optimizer_state(fresh_opt.optimizer)
    grace_dgc.load_gathered_state(fresh_opt, checkpoint["grace"] if checkpoint is not None else None)
    train(fresh, fresh_opt, range(3, 6))
    residuals, resumed = opt.grace.memory.residuals, fresh_opt.grace.memory.residuals
    return [name for (name, p), q in zip(model.named_parameters(), fresh.parameters()) if not torch.equal(p, q)] + [
        f"residual {name}" for name, r in residuals.items() if not torch.equal(r, resumed[name])
    ]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shared", [True, False], ids=["every rank reads the file", "rank 0 sends the parts"])
def test_a_rank_0_only_checkpoint_resumes_every_rank_exactly(world, shared, tmp_path):
    results = run_ranks(rank0_checkpoint_job, world, (str(tmp_path / "ckpt.pt"), shared), timeout=180)
    assert results == [[]] * world, results


def test_a_gathered_state_of_another_world_size_or_format_is_refused():
    grace = grace_dgc.build("topk", "residual", "allgather", engine="local")
    grace.step(torch.randn(20), "w")
    gathered = grace_dgc.gather_state(grace)
    assert gathered["world_size"] == 1 and "w" in gathered["ranks"][0]["memory"]["residuals"]
    with pytest.raises(GraceConfigError, match="holds 2 ranks; this run has 1"):
        grace_dgc.load_gathered_state(grace, dict(gathered, world_size=2))
    with pytest.raises(GraceConfigError, match="needs gather_state"):
        grace_dgc.load_gathered_state(grace, grace.state_dict())


# -- torch.distributed.checkpoint ----------------------------------------------------------


def dcp_job(rank, world_size, path, comm):
    """3 steps, a DCP save of model + wrapped optimizer + PerRankState, 3 more steps; fresh
    objects load the checkpoint and take the same 3 steps. Returns (bit-exact, the grace
    state entries DCP wrote)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        if comm == "reduce_scatter":
            return small_training("qsgd", comm, quantum_num=4)
        return small_training("topk", comm, compress_ratio=0.2)

    def train(model, opt, steps):
        return train_steps(model, opt, steps, rank)

    model, opt = make()
    train(model, opt, range(3))
    model_state, optim_state = get_state_dict(model, opt.optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(opt)}, checkpoint_id=path)
    expected = train(model, opt, range(3, 6))

    model, opt = make()
    model_state, optim_state = get_state_dict(model, opt.optimizer)
    state = {"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(opt)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = train(model, opt, range(3, 6))
    written = sorted(k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata if "grace" in k)
    return all(torch.equal(a, b) for a, b in zip(expected, got)), written


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("comm", ["allgather", "reduce_scatter"])
def test_torch_distributed_checkpoint_keeps_every_ranks_grace_state(tmp_path, world, comm):
    results = run_ranks(dcp_job, world, (str(tmp_path / "ckpt"), comm), timeout=300)
    for rank, (exact, written) in enumerate(results):
        assert exact, f"rank {rank}: the run resumed from DCP differs"
        assert written == [f"grace.rank{r}" for r in range(world)]


def test_per_rank_state_names_a_missing_rank():
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.2)
    with pytest.raises(GraceConfigError, match="no grace state for rank0"):
        grace_dgc.PerRankState(grace).load_state_dict({"rank1": grace.state_dict()})
