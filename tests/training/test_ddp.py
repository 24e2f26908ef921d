"""DistributedDataParallel with grace's communication hook, on 2 real gloo ranks.

References: DDP's built-in allreduce and torch's fp16_compress_hook (bit for bit),
DistributedOptimizer on the same model and data (bit for bit), an uninterrupted run
(checkpoint → reload → continue). One run_ranks call does every case.
"""

import io
import pickle
import warnings

import pytest
import torch
from ranks import run_ranks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.training.ddp import grace_hook

WORLD, STEPS = 2, 5


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
    )


def batches(rank, steps=STEPS, per_rank=8):
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(per_rank, 8, generator=gen), torch.randint(0, 3, (per_rank,), generator=gen)) for _ in range(steps)
    ]


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def train(model, opt, data):
    """Per step: (gradients as the optimizer saw them, parameters after the step)."""
    trace = []
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # DistributedOptimizer writes the averaged gradients into .grad
        trace.append((flat(p.grad for p in model.parameters()), flat(model.parameters())))
    return trace


def ddp_with(seed, hook=None, state=None):
    """A DDP model with small buckets (~500 floats: several buckets, several parameters in some)."""
    ddp = DDP(make_model(seed), bucket_cap_mb_list=[0.002])
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def recording(hook, log):
    """``hook`` that also logs, per bucket: (parameter count, local buffer in, buffer out)."""

    def logged(state, bucket):
        entry = [len(bucket.parameters()), bucket.buffer().clone(), None]
        log.append(entry)  # in call order (completions may come in another order)

        def done(future):
            entry[2] = future.value().clone()
            return future.value()

        return hook(state, bucket).then(done)

    return logged


def grace_ddp(rank, method, data, model_names=True, seed=0):
    comp, mem, comm, params = method
    grace = grace_dgc.build(comp, mem, comm, **params)
    ddp = ddp_with(seed)
    state, hook = grace_dgc.ddp_comm_hook(grace, ddp if model_names else None)
    buckets = []
    ddp.register_comm_hook(state, recording(hook, buckets))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    return ddp, opt, state, buckets


TOPK = ("topk", "residual", "allgather", {"compress_ratio": 0.1})
RANDOMK = ("randomk", "residual", "allreduce", {"compress_ratio": 0.2})


def ddp_job(rank, world_size):
    data = batches(rank)
    out = {}
    # built-in DDP allreduce vs grace none/allreduce
    ddp = ddp_with(0)
    out["builtin"] = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), data)
    ddp, _, _, out["buckets"] = grace_ddp(rank, ("none", "none", "allreduce", {}), data)
    out["grace_none"] = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), data)
    # torch's fp16 hook vs grace fp16/allreduce, on the same parameters (lr=0) every step
    out["builtin_fp16_buckets"] = []
    ddp = ddp_with(0, recording(fp16_compress_hook, out["builtin_fp16_buckets"]), None)
    out["builtin_fp16"] = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), data)
    ddp, _, _, out["grace_fp16_buckets"] = grace_ddp(rank, ("fp16", "none", "allreduce", {}), data)
    out["grace_fp16"] = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), data)

    # topk + residual: DDP hook vs DistributedOptimizer
    ddp, opt, state, _ = grace_ddp(rank, TOPK, data)
    out["grace_topk"] = train(ddp, opt, data)
    out["topk_stats"] = state.grace.stats()
    model = make_model(0)
    dopt = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        grace_dgc.build(TOPK[0], TOPK[1], TOPK[2], **TOPK[3]),
        model.named_parameters(),
    )
    out["dopt_topk"] = train(model, dopt, data)

    # checkpoint after 2 steps → fresh objects (another init) → load → continue
    for key, method, model_names in (("topk", TOPK, True), ("randomk", RANDOMK, False)):
        ddp, opt, state, _ = grace_ddp(rank, method, data, model_names)
        uninterrupted = train(ddp, opt, data)
        ddp, opt, state, _ = grace_ddp(rank, method, data, model_names)
        first = train(ddp, opt, data[:2])
        buffer = io.BytesIO()
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "grace": state.state_dict()}, buffer)
        del ddp, opt, state
        ddp, opt, state, _ = grace_ddp(rank, method, data, model_names, seed=5)
        checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        ddp.module.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        state.load_state_dict(checkpoint["grace"])
        resumed = first + train(ddp, opt, data[2:])
        out[f"resume_{key}"] = (uninterrupted, resumed, sorted(checkpoint["grace"]["grace"]["memory"]["residuals"]))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(ddp_job, WORLD)


def assert_traces_equal(a, b, what):
    assert len(a) == len(b) == STEPS or len(a) == len(b), what
    for step, ((grad_a, param_a), (grad_b, param_b)) in enumerate(zip(a, b)):
        assert torch.equal(grad_a, grad_b), (what, "gradients", step, (grad_a - grad_b).abs().max())
        assert torch.equal(param_a, param_b), (what, "parameters", step)


@pytest.mark.fast
def test_none_equals_ddps_builtin_allreduce_bit_for_bit(results):
    for rank, r in enumerate(results):
        assert_traces_equal(r["grace_none"], r["builtin"], ("none vs DDP allreduce", rank))
    # the hook ran per bucket: several buckets, several parameters in some, DDP rebuilt them
    iterations, current = [], []
    for count, _, _ in results[0]["buckets"]:
        current.append(count)
        if sum(current) == 6:  # the model has 6 parameters
            iterations.append(tuple(current))
            current = []
    assert len(iterations) == STEPS and not current
    assert all(len(it) > 1 for it in iterations) and max(map(max, iterations)) > 1
    assert iterations[0] != iterations[1] == iterations[-1], iterations  # rebuilt after the first


@pytest.mark.fast
def test_fp16_equals_fp16_compress_hook_bit_for_bit(results):
    """Per bucket: grace's fp16 hook result equals torch's fp16_compress_hook exactly, and
    both equal the formula written here from the ranks' local gradients h_r:
    fp32(Σ_r fp16(h_r) / N), the sum taken in fp16."""

    def formula(halves):
        total = halves[0] / WORLD
        for h in halves[1:]:
            total = total + h / WORLD
        return total.float()

    for key in ("grace_fp16_buckets", "builtin_fp16_buckets"):
        for calls in zip(*(r[key] for r in results)):
            halves = [local.half() for _, local, _ in calls]
            for _, _, out in calls:
                assert torch.equal(out, formula(halves)), key
    for grace_calls, torch_calls in zip(
        zip(*(r["grace_fp16_buckets"] for r in results)), zip(*(r["builtin_fp16_buckets"] for r in results))
    ):
        assert all(torch.equal(a[1], b[1]) for a, b in zip(grace_calls, torch_calls))  # same inputs
        assert all(torch.equal(a[2], b[2]) for a, b in zip(grace_calls, torch_calls))  # same outputs
    assert len(results[0]["grace_fp16_buckets"]) == len(results[0]["builtin_fp16_buckets"]) > STEPS


@pytest.mark.fast
def test_topk_residual_equals_distributed_optimizer(results):
    for rank, r in enumerate(results):
        assert_traces_equal(r["grace_topk"], r["dopt_topk"], ("topk hook vs DistributedOptimizer", rank))
        assert not torch.equal(r["grace_topk"][-1][0], r["grace_none"][-1][0])
    stats = results[0]["topk_stats"]
    assert stats["steps"] == STEPS and stats["compression_ratio"] < 0.5


@pytest.mark.fast
def test_ranks_stay_identical(results):
    for key in ("builtin", "grace_none", "builtin_fp16", "grace_fp16", "grace_topk"):
        for (_, params_0), (_, params_1) in zip(results[0][key], results[1][key]):
            assert torch.equal(params_0, params_1), key


@pytest.mark.fast
def test_checkpoint_resume_equals_uninterrupted(results):
    for rank, r in enumerate(results):
        for key in ("topk", "randomk"):
            uninterrupted, resumed, names = r[f"resume_{key}"]
            assert_traces_equal(resumed, uninterrupted, (key, "resume", rank))
        # memory is keyed by the model's parameter names, or param.<k> without a model
        assert r["resume_topk"][2] == sorted(n for n, _ in make_model().named_parameters())
        assert r["resume_randomk"][2] == sorted(f"param.{k}" for k in range(6))


@pytest.mark.parametrize("momentum, warned", [(0.9, True), (0.0, False)])
def test_the_momentum_memory_without_an_optimizer_warns_of_momentum_applied_twice(caplog, momentum, warned):
    grace = grace_dgc.build("dgc", "momentum", "allgather", engine="local", momentum=momentum)
    with caplog.at_level("WARNING", logger="grace_dgc"):
        grace_dgc.ddp_comm_hook(grace, make_model())
    assert ("applied twice" in caplog.text) is warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="grace_dgc"):  # given, its momentum is taken over: no warning
        model = make_model()
        grace = grace_dgc.build("dgc", "momentum", "allgather", engine="local", momentum=momentum)
        grace_dgc.ddp_comm_hook(grace, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert "applied twice" not in caplog.text


def test_bad_input_and_pickling():
    grace = grace_dgc.build(engine="local")
    with pytest.raises(grace_dgc.GraceConfigError, match="needs a Grace"):
        grace_dgc.ddp_comm_hook(object())
    with pytest.raises(grace_dgc.GraceConfigError, match="optimizer needs the model"):
        grace_dgc.ddp_comm_hook(grace, None, torch.optim.SGD(make_model().parameters(), lr=0.1))
    state, hook = grace_dgc.ddp_comm_hook(grace, make_model())
    assert hook is grace_hook
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(state)
    # deliberate change (issue 10): a state says what it is: format, methods, world size
    assert pickle.loads(pickle.dumps(state.state_dict())) == {
        # issue 55: the header every way in's state has (the training wing's Driver)
        "format": 2,
        "hook": "GraceHookState",
        "settings": {},
        "stats": {},
        "grace": {
            "format": 2,
            "methods": {"compressor": "none", "memory": "none", "communicator": "allreduce"},
            "world_size": 1,
            "rank": 0,  # issue 39: a resume on another rank is warned about
            "settings": {"compressor": {}, "memory": {}, "communicator": {}},  # issue 26
            "compressor": {},
            "memory": {},
            "communicator": {},  # issue 9: reduce_scatter's owner-side errors live here
            "counters": grace.counters(),  # issue 53: a resumed run's stats go on from the saved ones
        },
    }
    assert set(state.state_dict()["grace"]["counters"]) == {"stats", "seconds", "steps", "wait_seconds"}


class FakeBucket:
    """What the hook reads from DDP's GradBucket: a flat buffer and per-parameter views."""

    def __init__(self, params, index=0):
        self._params, self._index = params, index
        self._buffer = torch.cat([torch.arange(p.numel(), dtype=torch.float32) - 2.5 for p in params])
        sizes = [p.numel() for p in params]
        self._grads = [v.view(p.shape) for v, p in zip(self._buffer.split(sizes), params)]

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return False


def test_hook_writes_each_parameters_exchange_into_the_bucket_and_reports_errors():
    """One process (local engine): topk keeps k = ⌊0.34·n⌋ largest of each parameter's gradient;
    without a model, parameters are named in the order the hook first sees them."""
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    state, hook = grace_dgc.ddp_comm_hook(
        grace_dgc.build("topk", "residual", "allgather", engine="local", compress_ratio=0.34)
    )
    bucket = FakeBucket([b, a])
    out = hook(state, bucket).wait()
    assert out is bucket.buffer()
    # b: [-2.5, -1.5, -0.5, 0.5] keeps k=1: -2.5; a: [-2.5, ..., 2.5] keeps k=2: -2.5, 2.5
    assert out.tolist() == [-2.5, 0, 0, 0, -2.5, 0, 0, 0, 0, 2.5]
    assert state._names == {b: "param.0", a: "param.1"}
    residuals = state.state_dict()["grace"]["memory"]["residuals"]
    assert residuals["param.0"].tolist() == [0, -1.5, -0.5, 0.5]

    def broken(tensor, name):
        raise ValueError(f"compensate failed for {name}")

    # a bucket's views and names are kept from the second time its buffer is seen (DDP's first
    # buckets, rebuilt after one iteration, are not kept alive); a rebuilt bucket (another
    # buffer under the same index) drops what was kept of the old ones
    assert state.bucket(bucket).grads is state.bucket(bucket).grads
    rebuilt = FakeBucket([a])
    assert state.bucket(rebuilt).names == ["param.1"] and not state._buckets
    assert state.bucket(rebuilt).buffer is rebuilt.buffer() and state._buckets[0].buffer is rebuilt.buffer()

    state.grace.memory.compensate = broken
    with pytest.raises(ValueError, match="compensate failed for param.1"):
        hook(state, FakeBucket([a], index=1)).wait()


def ddp_join_job(rank, world_size):
    """Uneven inputs under DDP: torch's own ``Join`` shadows the ranks that ran out of data
    by calling the comm hook on zero buckets, so grace's hook needs nothing more."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from grace_dgc.training.ddp import GraceHookState, grace_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ddp = DistributedDataParallel(model)
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
    ddp.register_comm_hook(GraceHookState(grace, ddp), grace_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp]):
        for step in range(2 + 3 * rank):
            optimizer.zero_grad()
            ddp(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()], grace.stats()["steps"]


def test_ddp_join_with_the_grace_hook_runs_uneven_inputs_to_the_end():

    (params0, steps0), (params1, steps1) = run_ranks(ddp_join_job, 2, timeout=120)
    assert steps0 == steps1 == 5  # rank 0 shadowed rank 1's last three steps
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def find_unused_job(rank, world_size):
    """DDP(find_unused_parameters=True) and grace on one group: refused by name (it used to hang
    whenever the ranks ordered DDP's used-parameter allreduce and grace's exchange differently);
    grace on a group of its own, the default of build, trains."""
    import torch.distributed as dist

    model = DDP(make_model(), find_unused_parameters=True)
    try:
        shared = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.3, process_group=dist.group.WORLD)
        grace_dgc.ddp_comm_hook(shared, model)
        refused = None
    except GraceConfigError as error:
        refused = str(error)
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.3)
    model.register_comm_hook(*grace_dgc.ddp_comm_hook(grace, model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, batches(rank))
    return refused, flat(model.parameters())


def test_find_unused_parameters_needs_grace_on_a_group_of_its_own():
    (refused, a), (_, b) = run_ranks(find_unused_job, 2)
    assert refused is not None and "find_unused_parameters=True" in refused and "without process_group" in refused
    assert torch.equal(a, b)


def forgotten_resume_job(rank, world_size):
    """3 steps through the hook with the optimizer given, a checkpoint, then fresh objects resumed
    three ways; per way, the grace warnings of the first resumed steps."""

    def make():
        ddp = ddp_with(0)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        state, hook = grace_dgc.ddp_comm_hook(grace_dgc.build(*TOPK[:3], **TOPK[3]), ddp, opt)
        ddp.register_comm_hook(state, hook)
        return ddp, opt, state

    data = batches(rank)
    ddp, opt, state = make()
    train(ddp, opt, data[:3])
    saved = {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "grace": state.state_dict()}
    rank0 = [saved if rank == 0 else None]
    torch.distributed.broadcast_object_list(rank0, src=0)
    caught_by_way = {}
    for how in ("model and optimizer only", "rank 0's hook state everywhere", "every rank its own"):
        ddp, opt, state = make()
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if how == "rank 0's hook state everywhere":
            state.load_state_dict(rank0[0]["grace"])
        elif how == "every rank its own":
            state.load_state_dict(saved["grace"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(ddp, opt, data[3:])
        caught_by_way[how] = [str(w.message) for w in caught if "grace" in str(w.message)]
    return caught_by_way


def test_a_hook_resume_that_forgot_the_hooks_state_warns_naming_the_hooks_state():
    """The warning names the route a hook user holds (``state.load_state_dict``, the hook's
    ``gather_state``), not the DistributedOptimizer's; a resume that restored it is silent."""
    for rank, caught in enumerate(run_ranks(forgotten_resume_job, WORLD)):
        forgot = caught["model and optimizer only"]
        assert len(forgot) == 1 and "grace's state starts empty" in forgot[0], (rank, forgot)
        assert "state.load_state_dict()" in forgot[0] and "DDP hook's state" in forgot[0], forgot[0]
        assert "DistributedOptimizer" not in forgot[0] and "gather_state(state)" in forgot[0], forgot[0]
        everywhere = caught["rank 0's hook state everywhere"]
        if rank == 0:
            assert everywhere == [], everywhere
        else:
            assert len(everywhere) == 1 and "rank 1 resumed from rank 0's grace state" in everywhere[0], everywhere
            assert "state.load_state_dict()" in everywhere[0] and "DistributedOptimizer" not in everywhere[0]
        assert caught["every rank its own"] == [], caught["every rank its own"]


def docs_script_job(rank, world_size, script, out_dir):
    """docs/engines.md's DDP hook script, as printed, on these ranks: run whole, then again with
    ``resume``. The pool's ranks already hold the process group the script's first line makes,
    so ``init_process_group`` and ``destroy_process_group`` are the only calls left out."""
    import contextlib
    import os
    import sys
    from unittest import mock

    printed = []
    for argv in ([], ["resume"]):
        out = io.StringIO()
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(torch.distributed, "init_process_group"))
            stack.enter_context(mock.patch.object(torch.distributed, "destroy_process_group"))
            stack.enter_context(mock.patch.object(sys, "argv", ["ddp_hook.py", *argv]))
            stack.enter_context(mock.patch.dict(os.environ, {"OUT_DIR": out_dir}))
            stack.enter_context(contextlib.redirect_stdout(out))
            exec(compile(script, "ddp_hook.py", "exec"), {"__name__": "__main__"})
        printed.append(out.getvalue().strip())
    return printed


def test_the_hook_script_of_the_docs_saves_and_resumes_bit_for_bit_as_printed(tmp_path):
    """docs/engines.md 'With DDP': the run resumed from its step-10 checkpoint (each rank its own
    file, the hook's state among it) ends with the uninterrupted run's parameters and bytes."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    section = page[page.index("## With DDP") :]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "state.load_state_dict(" in script and "state.state_dict()" in script
    for rank, (whole, resumed) in enumerate(run_ranks(docs_script_job, WORLD, (script, str(tmp_path)))):
        assert re.fullmatch(rf"rank {rank} parameters \w{{16}} bytes \d+", whole), whole
        assert whole == resumed, (whole, resumed)
