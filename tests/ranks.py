"""Multi-rank cases on ranks kept up for the whole test run.

``run_ranks(fn, world_size, args)`` has :func:`grace_dgc.launch.run_local`'s contract (results
in rank order, a rank's traceback raised, ``timeout`` enforced) but runs on a
:class:`grace_dgc.launch.RankPool` per (world size, backend), started at its first use and
closed at the end of the session: a job costs a process group's set-up (~0.02 s), not a start of
processes and a torch import per rank (17-26 s on 2 cores). Each job starts from what a fresh
rank would find (the pool's baseline: RNG, threads, dtype, kernels' mode) and, as a spawned
child would, from the caller's environment, working directory and import path at the call.
A job that fails or overruns tears its ranks down, and the next job starts fresh ones, so a
failure never reaches the next case.

Under ``pytest --fast`` (``make test-fast``) a case that reaches ``run_ranks``, or starts
processes any other way (the library's ``run_local`` or ``RankPool``, a subprocess: conftest.py
routes them through :func:`skip_unless_fast`), is skipped unless it is marked
``@pytest.mark.fast``: the fast tier keeps a few multi-rank cases, chosen to cover each part and
each way in, and every single-process test.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

from grace_dgc.launch import RankPool, rank_environment

T = TypeVar("T")

_POOLS: dict[tuple[int, str, str], RankPool] = {}
FAST: dict[str, Any] = {"on": False, "item": None}  # set by conftest.py: the tier, the running test
# set by the rank's worker or launcher (and HOROVOD_*), so never taken from the caller's environment
_RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def pool(world_size: int, backend: str = "gloo", engine: str = "torch") -> RankPool:
    """The session's pool of ``world_size`` ranks on ``backend`` (``engine="horovod"``: under
    horovodrun)."""
    key = (world_size, backend, engine)
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, backend, engine)
    return _POOLS[key]


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    args: Sequence[object] = (),
    backend: str = "gloo",
    timeout: float = 300,
    engine: str = "torch",
) -> list[T]:
    """``[fn(rank, world_size, *args) for each rank]`` on the session's kept-up ranks."""
    skip_unless_fast("a multi-rank case")
    environ = {**os.environ, **rank_environment(world_size)}
    job = pickle.dumps((fn, tuple(args)))
    return pool(world_size, backend, engine).run(
        _as_spawned, (job, environ, os.getcwd(), list(sys.path)), timeout=timeout
    )


def skip_unless_fast(what: str) -> None:
    """Under ``--fast``, skip the running test unless it is marked ``fast``: it starts ranks or
    processes (conftest.py routes every way of starting them here)."""
    item = FAST["item"]
    if FAST["on"] and item is not None and item.get_closest_marker("fast") is None:
        pytest.skip(f"{what}: in the whole suite (make test), not the fast tier")


def _as_spawned(rank: int, world_size: int, job: bytes, environ: dict[str, str], cwd: str, path: list[str]) -> Any:
    """Run the job as a freshly spawned rank would: the caller's environment (but this rank's
    own variables), working directory and import path, then ``fn`` unpickled (its module may be
    one this rank has not imported yet)."""
    own = {name: value for name, value in os.environ.items() if name in _RANK_VARIABLES or name.startswith("HOROVOD_")}
    os.environ.clear()
    os.environ.update({**environ, **own})
    os.chdir(cwd)
    sys.path[:] = path + [entry for entry in sys.path if entry not in path]
    fn, args = pickle.loads(job)
    return fn(rank, world_size, *args)


def close_all(engine: str | None = None) -> None:
    """Close the session's pools (of one ``engine`` only, if given)."""
    for key in [key for key in _POOLS if engine is None or key[2] == engine]:
        _POOLS.pop(key).close()
