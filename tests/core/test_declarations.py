"""Every setting in the handshake, every piece of state in the checkpoint (issue 26).

Each registered part declares its settings (compared across ranks, recorded in a
checkpoint), its state (saved, loaded, reset, restored after a skipped step) and what is
rank-local on purpose (``grace_dgc.interfaces.Part``). These tests walk every registered
part, every environment variable the library reads and every tensor a part keeps across
steps, and fail on one that none of the declarations names.
"""

from __future__ import annotations

import inspect
import io
import pathlib
import random

import pytest
import torch
from conftest import variables_read

import grace_dgc
from grace_dgc import environment
from grace_dgc.errors import GraceConfigError
from grace_dgc.interfaces import Part
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS, MEMORIES

# a compressor and memory each communicator carries, to run it for a few steps
CARRIED = {
    "allreduce": ("fp16", "residual"),
    "allgather": ("topk", "residual"),
    "broadcast": ("topk", "residual"),
    "sparse_allreduce": ("topk", "residual"),
    "reduce_scatter": ("qsgd", "residual"),
    "hierarchical": ("qsgd", "residual"),
    "auto": ("qsgd", "residual"),
}
FITTING_MEMORY = {"powersgd": "powersgd", "efsignsgd": "efsignsgd", "dgc": "momentum"}


def constructor_parameters(cls):
    skip = {"self", "engine", "args", "kwargs"}
    return [name for name in inspect.signature(cls.__init__).parameters if name not in skip]


def every_part():
    for kind, registry in (("compressor", COMPRESSORS), ("memory", MEMORIES), ("communicator", COMMUNICATORS)):
        for name in registry.names():
            yield kind, name


def built(kind, name):
    """A Grace whose ``kind`` part is ``name``, on one local rank, after three steps of two
    tensors (a matrix, for PowerSGD's low rank, and a vector)."""
    if kind == "compressor":
        fitting = [c for c in ("allreduce", "allgather") if COMMUNICATORS.get(c).fits(COMPRESSORS.get(name)())]
        grace = grace_dgc.build(name, FITTING_MEMORY.get(name, "residual"), fitting[0], engine="local")
    elif kind == "memory":
        compressor = {"powersgd": "powersgd", "efsignsgd": "efsignsgd", "momentum": "dgc"}.get(name, "topk")
        comm = "allreduce" if compressor == "powersgd" else "allgather"
        grace = grace_dgc.build(compressor, name, comm, engine="local")
    else:
        compressor, memory = CARRIED[name]
        grace = grace_dgc.build(compressor, memory, name, engine="local")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        grace.step_group_async([torch.randn(8, 6, generator=gen), torch.randn(5, generator=gen)], ["w", "b"]).result()
    return grace, {"compressor": grace.compressor, "memory": grace.memory, "communicator": grace.communicator}[kind]


@pytest.mark.parametrize("kind, name", list(every_part()))
def test_every_constructor_parameter_is_a_setting_state_or_rank_local(kind, name):
    _, part = built(kind, name)
    declared = set(part.agreed_settings()) | set(part.STATE) | set(part.RANK_LOCAL)
    undeclared = [p for p in constructor_parameters(type(part)) if p not in declared]
    assert not undeclared, f"{kind} {name}: parameters {undeclared} are in neither SETTINGS, STATE nor RANK_LOCAL"
    assert set(part.RESUME_MAY_DIFFER) <= set(part.agreed_settings()), "RESUME_MAY_DIFFER names settings"


def kept(value):
    """Does ``value`` hold something that lives across steps (a tensor, a random state)?"""
    if isinstance(value, (torch.Tensor, torch.Generator, random.Random)):
        return True
    if isinstance(value, dict):
        return any(kept(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(kept(v) for v in value)
    return False


def walk(part, path):
    """(path, part, attribute) for every attribute of ``part`` and of the parts it holds."""
    for attribute, value in vars(part).items():
        yield path, part, attribute
        children = value.values() if isinstance(value, dict) else [value]
        for child in children:
            if isinstance(child, Part):
                yield from walk(child, f"{path}.{attribute}")


@pytest.mark.parametrize("kind, name", list(every_part()))
def test_every_tensor_a_part_keeps_across_steps_is_state_or_rank_local(kind, name):
    _, part = built(kind, name)
    undeclared = [
        f"{path}.{attribute}"
        for path, owner, attribute in walk(part, name)
        if kept(getattr(owner, attribute)) and attribute not in owner.STATE and attribute not in owner.RANK_LOCAL
    ]
    assert not undeclared, f"{kind} {name} keeps {undeclared} across steps, declared neither STATE nor RANK_LOCAL"


@pytest.mark.parametrize("kind, name", list(every_part()))
def test_the_state_round_trips_through_torch_load_with_weights_only(kind, name):
    grace, part = built(kind, name)
    state = part.state_dict()
    assert set(state) >= set(part.STATE)
    buffer = io.BytesIO()
    torch.save(grace.state_dict(), buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    fresh, _ = built(kind, name)  # three steps of its own, then overwritten by the load
    fresh.load_state_dict(loaded)
    assert_same(fresh.state_dict(), grace.state_dict())


@pytest.mark.parametrize("kind, name", list(every_part()))
def test_a_rejoining_rank_adopts_only_what_every_rank_holds_alike(kind, name):
    """Part.heal (torchft's heal of a restarted group): the peer's REPLICATED state bit for bit,
    none of its own per-rank state (a peer's residual taken over would be sent a second time),
    and nothing of what the healed rank kept before."""
    _, peer = built(kind, name)
    assert set(peer.REPLICATED) <= set(peer.STATE), f"{kind} {name}: REPLICATED names attributes of STATE"
    saved = peer.state_dict()
    _, healed = built(kind, name)  # three steps of its own: all of it goes
    healed.heal(saved)
    after = healed.state_dict()
    for key in peer.STATE:
        value = getattr(healed, key)
        if isinstance(value, Part) or (
            isinstance(value, dict) and value and isinstance(next(iter(value.values())), Part)
        ):
            continue  # a nested part answers for its own (it is registered and walked too)
        if key in peer.REPLICATED:
            assert_same(after[key], saved[key], f"{kind} {name}.{key}")
        elif isinstance(value, dict):
            assert value == {}, f"{kind} {name}.{key}: a rank's own state is not taken from a peer"


def replicated_state_job(rank, world, kind, name):
    import torch.distributed as dist

    grace = grace_dgc.build(*parts_of(kind, name), process_group=None)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own gradients
    for _ in range(3):
        grace.step_group_async([torch.randn(8, 6, generator=gen), torch.randn(5, generator=gen)], ["w", "b"]).result()
    part = {"compressor": grace.compressor, "memory": grace.memory, "communicator": grace.communicator}[kind]
    mine = {key: part.state_dict()[key] for key in part.REPLICATED}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    grace.close()
    return everyone


def parts_of(kind, name):
    if kind == "compressor":
        fitting = [c for c in ("allreduce", "allgather") if COMMUNICATORS.get(c).fits(COMPRESSORS.get(name)())]
        return name, FITTING_MEMORY.get(name, "residual"), fitting[0]
    if kind == "memory":
        compressor = {"powersgd": "powersgd", "efsignsgd": "efsignsgd", "momentum": "dgc"}.get(name, "topk")
        return compressor, name, "allreduce" if compressor == "powersgd" else "allgather"
    return (*CARRIED[name], name)


@pytest.mark.fast
def test_what_a_part_declares_replicated_is_equal_on_every_rank():
    """The declarations a heal relies on, checked against 2 gloo ranks with different gradients:
    every REPLICATED attribute is bitwise the same on both after three steps."""
    from ranks import run_ranks

    cases = [(kind, name) for kind, name in every_part() if kind != "communicator" or name != "hierarchical"]
    cases = [(k, n) for k, n in cases if getattr(built(k, n)[1], "REPLICATED", ())]
    assert cases, "some part declares replicated state"
    for kind, name in cases:
        first, second = run_ranks(replicated_state_job, 2, (kind, name), timeout=120)[0]
        assert_same(first, second, f"{kind} {name}")


def assert_same(a, b, path="state"):
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert sorted(a, key=repr) == sorted(b, key=repr), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


# -- the checkpoint knows what it was made with ------------------------------------------


@pytest.mark.parametrize(
    "saved, loading, named",
    [
        (("topk", "residual", "allgather", {"compress_ratio": 0.1}), {"compress_ratio": 0.2}, "compress_ratio"),
        (("qsgd", "residual", "allgather", {"quantum_num": 64}), {"quantum_num": 8}, "quantum_num"),
        (("topk", "residual", "allgather", {"beta": 1.0}), {"beta": 0.5}, "beta"),
        (("dgc", "momentum", "allgather", {"momentum": 0.9}), {"momentum": 0.5}, "momentum"),
        (("qsgd", "residual", "reduce_scatter", {}), {"error_feedback": False}, "error_feedback"),
        (("qsgd", "residual", "hierarchical", {"group_size": 1}), {"outer": "broadcast"}, "outer"),
    ],
)
def test_a_checkpoint_of_other_settings_is_refused_naming_the_setting_and_both_values(saved, loading, named):
    comp, mem, comm, params = saved
    grace = grace_dgc.build(comp, mem, comm, engine="local", **params)
    grace.step(torch.randn(30), "w")
    state = grace.state_dict()
    other = grace_dgc.build(comp, mem, comm, engine="local", **dict(params, **loading))
    before = other.state_dict()
    with pytest.raises(GraceConfigError, match=rf"{named}: saved .+, this run .+"):
        other.load_state_dict(state)
    assert_same(other.state_dict(), before)  # nothing was loaded


def test_a_difference_that_does_not_change_the_state_loads():
    saved = grace_dgc.build("efsignsgd", "efsignsgd", "allgather", engine="local", lr=0.1)
    saved.step(torch.randn(30), "w")
    target = grace_dgc.build("efsignsgd", "efsignsgd", "allgather", engine="local", lr=0.5, timeout=9)
    target.load_state_dict(saved.state_dict())
    assert target.memory.lr == 0.1  # the lr the schedule had reached comes with the state


def test_hierarchical_state_of_one_group_size_is_refused_by_another(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    saved = grace_dgc.build("qsgd", "residual", "hierarchical", engine="local", outer="reduce_scatter")
    saved.step(torch.randn(30), "w")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    same = grace_dgc.build("qsgd", "residual", "hierarchical", engine="local", outer="reduce_scatter")
    same.load_state_dict(saved.state_dict())  # the group size in effect is the same: 1
    assert same.state_dict()["communicator"]["outer"]["errors"].keys() == {"w"}


# -- the environment ---------------------------------------------------------------------

LIBRARY_SOURCE = pathlib.Path(grace_dgc.__file__).parent


def test_every_environment_variable_the_library_reads_is_listed_with_what_it_means():
    read = variables_read(LIBRARY_SOURCE)
    assert read - set(environment.VARIABLES) == set(), "read but not listed in grace_dgc.environment.VARIABLES"
    assert set(environment.VARIABLES) - read == set(), "listed but no longer read"
    # the survey's own are listed in grace_survey.environment (tests/survey/test_environment.py)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5", ""])
def test_a_bad_local_world_size_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(GraceConfigError, match=r"^LOCAL_WORLD_SIZE='.*' in the environment; accepted: a whole number"):
        grace_dgc.build("qsgd", "residual", "hierarchical", engine="local").step(torch.ones(4), "w")


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_a_bad_launcher_size_is_named(monkeypatch, variable):
    from grace_dgc.engines import detect_engine_name

    monkeypatch.setenv(variable, "two")
    with pytest.raises(GraceConfigError, match=rf"^{variable}='two' in the environment"):
        detect_engine_name()


def test_a_bad_local_rank_is_named(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(GraceConfigError, match=r"^LOCAL_RANK='first' in the environment"):
        environment.read_int("LOCAL_RANK", 0)
