"""Bad input and misuse end in clear errors (issue 10, first part): parameter validation,
``engine="auto"`` that cannot silently train alone, checkpoints that say what they are."""
import inspect
import io
import math
import os
import queue

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

import grace_dgc
from grace_dgc.errors import GraceConfigError, parse_value
from grace_dgc.launch import free_port
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS, MEMORIES

REGISTRIES = {"compressor": COMPRESSORS, "memory": MEMORIES, "communicator": COMMUNICATORS}
INFINITY_MEANS_SOMETHING = {("compressor", "threshold", "threshold"), ("compressor", "terngrad", "clip_factor")}


def parameters(kinds):
    """(kind, method, parameter, default) of every registered part whose default is of ``kinds``."""
    out = []
    for kind, registry in REGISTRIES.items():
        for name in registry.names():
            for param in list(inspect.signature(registry.get(name).__init__).parameters.values())[1:]:
                if type(param.default) in kinds:
                    out.append((kind, name, param.name, param.default))
    return out


def construct(kind, name, **params):
    cls = REGISTRIES[kind].get(name)
    return cls(grace_dgc.create_engine("local"), **params) if kind == "communicator" else cls(**params)


@pytest.mark.parametrize("kind, name, param, default", parameters({bool}))
@pytest.mark.parametrize("value", ["false", "False", "true", 0, 1, None, "no"])
def test_flags_accept_only_booleans(kind, name, param, default, value):
    with pytest.raises(GraceConfigError, match=rf"{param}=.* must be True or False"):
        construct(kind, name, **{param: value})
    assert getattr(construct(kind, name, **{param: not default}), param) is (not default)


@pytest.mark.parametrize("kind, name, param, default", parameters({int, float}))
def test_numbers_reject_nan_and_infinity_naming_the_parameter(kind, name, param, default):
    for value in (math.nan, -math.inf) + (() if (kind, name, param) in INFINITY_MEANS_SOMETHING else (math.inf,)):
        with pytest.raises(GraceConfigError, match=rf"{param}=.*(finite|out of range)"):
            construct(kind, name, **{param: value})


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(parameters({int, float})), st.floats(allow_nan=True, allow_infinity=True))
def test_any_number_is_accepted_or_refused_with_a_clear_error(spec, value):
    """Never a bare ValueError/TypeError from deep inside: either it builds, or the error
    names the parameter and what is accepted."""
    kind, name, param, _ = spec
    try:
        construct(kind, name, **{param: value})
    except GraceConfigError as error:
        assert param in str(error) and ("accepted" in str(error) or "must be" in str(error))


def test_infinity_where_it_means_something():
    assert construct("compressor", "threshold", threshold=math.inf).threshold == math.inf
    assert construct("compressor", "terngrad", clip_factor=math.inf).clip_factor == math.inf


def test_command_line_values_parse_booleans():
    assert parse_value("false") is False and parse_value("True") is True
    assert parse_value("0.01") == 0.01 and parse_value("[1, 2]") == [1, 2] and parse_value("None") is None
    assert parse_value("topk") == "topk"


# -- engine="auto" ------------------------------------------------------------------------

def test_auto_engine_refuses_to_train_alone_when_launched_as_one_of_several(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)    # building is fine
    with pytest.raises(GraceConfigError, match=r"WORLD_SIZE=2.*init_process_group"):
        grace.step(torch.ones(4), "w")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert grace_dgc.build().step(torch.ones(4), "w").tolist() == [1.0] * 4
    assert grace_dgc.build().world_size == 1


def built_before_init(rank, world_size, port, results):
    """A GRACE-style script: the parts are built before the process group exists."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        torch.set_num_threads(1)
        grace = grace_dgc.build("fp16", "none", "allreduce")
        before = grace.engine.name
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        average = grace.step(torch.full((3,), float(rank)), "w")
        results.put((rank, before, grace.engine.name, grace.world_size, average.tolist()))
        torch.distributed.destroy_process_group()
    except BaseException as error:      # noqa: BLE001  reported to the test
        results.put((rank, "error", repr(error), 0, []))


def test_parts_built_before_init_process_group_exchange_through_it():
    ctx = mp.get_context("spawn")
    results, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=built_before_init, args=(r, 2, port, results), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    got = []
    for _ in range(2):
        for _ in range(1200):
            if not results.empty():
                got.append(results.get())
                break
            procs[0].join(0.1)
        else:
            raise queue.Empty("a rank did not answer within 120 s")
    for proc in procs:
        proc.join(10)
    for rank, before, after, world, average in got:
        assert (before, after, world) == ("auto", "torch", 2), got
        assert average == [0.5] * 3


# -- checkpoints -----------------------------------------------------------------------------

METHODS = [("topk", "residual", "allgather", {"compress_ratio": 0.3}),
           ("dgc", "momentum", "allgather", {"compress_ratio": 0.3, "min_compress_size": 1}),
           ("randomk", "residual", "allreduce", {"compress_ratio": 0.3}),
           ("qsgd", "residual", "allgather", {}), ("signum", "none", "allgather", {}),
           ("powersgd", "powersgd", "allreduce", {}), ("efsignsgd", "efsignsgd", "allgather", {"lr": 0.1})]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m[0]}+{m[1]}")
def test_a_state_loads_with_weights_only_and_resumes_exactly(method):
    comp, mem, comm, params = method
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(5)]
    a = grace_dgc.build(comp, mem, comm, engine="local", **params)
    for g in grads[:3]:
        a.step(g, "w")
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state["format"] == 1 and state["methods"]["compressor"] == comp and state["world_size"] == 1
    b = grace_dgc.build(comp, mem, comm, engine="local", **params)
    b.load_state_dict(state)
    for g in grads[3:]:
        assert torch.equal(a.step(g, "w"), b.step(g, "w"))


def test_a_state_of_other_methods_or_another_world_size_is_refused_naming_both():
    topk = grace_dgc.build("topk", "residual", "allgather", engine="local")
    topk.step(torch.randn(10), "w")
    dgc = grace_dgc.build("dgc", "momentum", "allgather", engine="local")
    with pytest.raises(GraceConfigError, match=r"saved by compressor 'topk', memory 'residual'.*this Grace is "
                                               r"compressor 'dgc', memory 'momentum'"):
        dgc.load_state_dict(topk.state_dict())
    state = topk.state_dict()
    state["world_size"] = 2
    with pytest.raises(GraceConfigError, match="saved on 2 ranks; this run has 1"):
        grace_dgc.build("topk", "residual", "allgather", engine="local").load_state_dict(state)
    with pytest.raises(GraceConfigError, match="needs a Grace.state_dict"):
        dgc.load_state_dict({"epoch": 3})


def test_a_state_without_the_header_still_loads_and_a_foreign_one_is_named():
    a = grace_dgc.build("dgc", "momentum", "allgather", engine="local", min_compress_size=1)
    a.step(torch.randn(10), "w")
    old = {"compressor": a.compressor.state_dict(), "memory": a.memory.state_dict()}
    b = grace_dgc.build("dgc", "momentum", "allgather", engine="local", min_compress_size=1)
    b.load_state_dict(old)
    assert b.compressor.steps == {"w": 1}
    foreign = {"compressor": {}, "memory": {}}
    with pytest.raises(GraceConfigError, match=r"does not fit compressor 'dgc'.*another method"):
        b.load_state_dict(foreign)


# -- untrusted files and plugins ---------------------------------------------------------------

def test_a_broken_plugin_is_a_warning_naming_it_and_the_rest_works(tmp_path, monkeypatch):
    dist = tmp_path / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[grace_dgc.compressors]\nbroken = no_such_module_here:Thing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(COMPRESSORS, "_classes", dict(COMPRESSORS._classes))
    monkeypatch.setattr(COMPRESSORS, "_aliases", dict(COMPRESSORS._aliases))
    monkeypatch.setattr(COMPRESSORS, "_plugins_loaded", False)
    monkeypatch.setattr(COMPRESSORS, "broken", {})
    with pytest.warns(UserWarning, match=r"plugin 'broken' \(no_such_module_here:Thing, from broken-plugin\) "
                                         r"failed to import"):
        names = grace_dgc.list_compressors()
    assert "topk" in names and "broken" not in names
    with pytest.raises(GraceConfigError, match="did you mean|Did you mean"):
        grace_dgc.build("topkk")
    with pytest.raises(GraceConfigError, match="plugin 'broken'.*failed to import"):
        grace_dgc.build("broken")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_crafted_cifar_batch_is_refused_not_run(tmp_path, monkeypatch):
    import pickle

    from grace_dgc.survey import datasets
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Exploit(), b"labels": [0]}, protocol=2))
    called = []
    monkeypatch.setattr(os, "system", lambda command: called.append(command))
    with pytest.raises(ValueError, match=r"not a CIFAR-10 batch \(refusing .*system"):
        datasets._cifar_batch(str(path))
    assert called == []


# -- the configuration handshake ---------------------------------------------------------

def differing_job(rank, world_size, case):
    """Each rank builds what ``case`` gives it and takes two steps; returns the error text."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    if case == "communicator":
        grace = grace_dgc.build("topk", "residual", "allgather" if rank == 0 else "broadcast", compress_ratio=0.5)
    elif case == "seed":
        grace = grace_dgc.build("randomk", "residual", "allreduce", compress_ratio=0.5, seed=rank)
    elif case == "ratio":
        grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.01 if rank == 0 else 0.1)
    else:
        grace = grace_dgc.build("none", "none", "allreduce")
    params = list(model.named_parameters())
    if case == "order" and rank == 1:
        params = params[::-1]
    if case == "extra" and rank == 1:
        params.append(("extra", torch.nn.Parameter(torch.zeros(5))))
    fusion = 0 if case == "fusion" and rank == 1 else 4 * 2**20
    optimizer = grace_dgc.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), grace, params,
                                               fusion_bytes=fusion)
    try:
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    except GraceConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case, field", [
    ("communicator", "communicator — rank 0: allgather; rank 1: broadcast"),
    ("seed", "compressor parameters — rank 0: .*'seed', 0.*; rank 1: .*'seed', 1"),
    ("ratio", "compressor parameters — rank 0: .*0.01.*; rank 1: .*0.1"),
    ("order", "tensors \\(name, shape, dtype\\)"),
    ("extra", "tensors \\(name, shape, dtype\\)"),
    ("fusion", "tensors \\(name, shape, dtype\\)")])
def test_ranks_that_differ_get_an_error_naming_the_difference_on_every_rank(case, field):
    from grace_dgc.launch import run_local
    errors = run_local(differing_job, 2, (case,), timeout=120)
    for error in errors:
        assert error is not None and "the ranks run different configurations" in error
        assert __import__("re").search(field, error), error


# -- uneven participation ------------------------------------------------------------------

def unused_branch_job(rank, world_size, fusion):
    """Rank 1 never uses the second branch: its parameters are exchanged as zeros there."""
    torch.manual_seed(0)
    trunk, branch, head = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    modules = torch.nn.ModuleDict({"trunk": trunk, "branch": branch, "head": head})
    grace = grace_dgc.build("none", "none", "allreduce")
    optimizer = grace_dgc.DistributedOptimizer(torch.optim.SGD(modules.parameters(), lr=0.1), grace,
                                               modules.named_parameters(), fusion_bytes=fusion)
    out = []
    for step in range(3):
        x = torch.full((2, 4), float(rank + step + 1))
        optimizer.zero_grad()
        hidden = trunk(x) + (branch(x) if rank == 0 else 0)
        head(hidden).sum().backward()
        optimizer.synchronize()
        out.append({name: p.grad.clone() for name, p in modules.named_parameters()})
        with optimizer.skip_synchronize():
            optimizer.step()
    return out


@pytest.mark.parametrize("fusion", [0, 4 * 2**20])
def test_a_parameter_unused_on_one_rank_only_is_exchanged_as_zeros(fusion):
    from grace_dgc.launch import run_local
    first, second = run_local(unused_branch_job, 2, (fusion,), timeout=120)
    for a, b in zip(first, second):
        for name in a:
            assert torch.equal(a[name], b[name]), name         # ranks agree
        assert bool(a["branch.weight"].abs().sum() > 0)        # rank 0's branch gradient, halved


# -- timeouts and dead ranks ---------------------------------------------------------------

def failing_rank_job(rank, world_size, port, how, results):
    """Rank ``world_size - 1`` stops (SIGSTOP) or dies before the second step; the others
    must end in an error naming it within the timeout."""
    import signal
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    grace = grace_dgc.build("topk", "residual", "allgather", timeout=4, compress_ratio=0.5)
    grace.step(torch.ones(8), "w")
    if rank == world_size - 1:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(3)
    try:
        grace.step(torch.ones(8), "w")
        results.put((rank, "no error"))
    except grace_dgc.GraceCommError as error:
        results.put((rank, str(error)))


@pytest.mark.parametrize("how", ["stop", "die"])
def test_a_rank_that_stops_or_dies_is_named_within_the_timeout(how):
    import time
    ctx = mp.get_context("spawn")
    results, port, world = ctx.SimpleQueue(), free_port(), 3
    procs = [ctx.Process(target=failing_rank_job, args=(r, world, port, how, results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        got, deadline = {}, time.monotonic() + 90
        while len(got) < world - 1 and time.monotonic() < deadline:
            if results.empty():
                time.sleep(0.05)
                continue
            rank, message = results.get()
            got[rank] = message
        assert sorted(got) == [0, 1], f"survivors did not report within 90 s: {got}"
        for rank, message in got.items():
            assert f"failed on rank {rank} of 3" in message, message
            assert "rank 2 did not answer" in message, message
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)
