"""Run a function on N local ranks, each in its own process with a gloo (or NCCL)
process group on localhost; used by the CLI, the survey and the tests.

Results come back in rank order; a rank that raises makes the whole call raise with its
traceback, and a run that exceeds ``timeout`` is killed rather than left hanging.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch.multiprocessing as mp

from . import environment

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

T = TypeVar("T")


def threads_per_rank(ranks: int) -> int:
    """The intra-op threads each of ``ranks`` ranks on this machine runs with: one rule for
    every launcher (``run_local``, so the survey's own ranks; script mode's ``local``,
    torchrun and horovodrun prefixes), so that no launcher decides a comparison. The value
    of ``OMP_NUM_THREADS`` when set (the user's choice, for all of them), else the cores
    shared out, cores // ranks, at least 1."""
    given = environment.read_int("OMP_NUM_THREADS", None, low=1)
    return given if given is not None else max(1, (os.cpu_count() or 1) // ranks)


def rank_environment(ranks: int) -> dict[str, str]:
    """The variables that carry :func:`threads_per_rank` into a rank's process. They must be
    in its environment before torch starts: OpenMP reads them once, at load, and a thread
    count set later with ``torch.set_num_threads`` applies to the calling thread only, not to
    threads started afterwards (grace's communication thread, where PowerSGD multiplies)."""
    threads = str(threads_per_rank(ranks))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def conditions() -> dict[str, Any]:
    """The launch conditions this process runs under, as a run records them: its intra-op
    threads on this thread and on a thread started now (they differ when only
    ``torch.set_num_threads`` set them), ``OMP_NUM_THREADS``, the cores and the machine's load
    (1-minute load average, and per core)."""
    import threading

    import torch

    seen: list[int] = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()), name="grace-threads-probe")
    probe.start()
    probe.join()
    return {
        "threads": torch.get_num_threads(),
        "threads_other": seen[0],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        **machine_load(),
    }


def machine_load() -> dict[str, float | int | None]:
    """The machine's cores and its 1-minute load average per core (None where the platform
    has none): what it was doing as a run started (the survey's own previous run included)."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cores": cores, "load_per_core": None if load is None else round(load / cores, 2)}


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent not idle since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Neighbours:
    """How much of the machine other processes used while a run trained: the machine's CPU
    time over the run (/proc/stat) less the run's own (its ranks' CPU seconds), as a share of
    the run's wall time × the cores. Unlike a load average, which still carries the survey's
    previous run for a minute, it counts only what ran beside this one."""

    def __init__(self) -> None:
        self.started, self.busy = time.perf_counter(), _busy_seconds()

    def share(self, own_cpu_seconds: float) -> float | None:
        busy = _busy_seconds()
        wall = time.perf_counter() - self.started
        if busy is None or self.busy is None or wall <= 0:
            return None
        others = max(0.0, busy - self.busy - own_cpu_seconds)
        return round(min(1.0, others / (wall * (os.cpu_count() or 1))), 3)


def launch_record(
    launcher: str, ranks: Sequence[Mapping[str, object]], start: Mapping[str, object], others: float | None
) -> dict[str, object]:
    """What a run's summary records of how it was launched: the launcher, each rank's threads
    (:func:`conditions`), the load per core as it started, and the share of the machine other
    processes used while it trained (:class:`Neighbours`)."""
    return {
        "launcher": launcher,
        "threads": [r.get("threads") for r in ranks],
        "threads_other": [r.get("threads_other") for r in ranks],
        "omp_num_threads": ranks[0].get("omp_num_threads") if ranks else None,
        "cores": start.get("cores"),
        "load_start": start.get("load_per_core"),
        "others_share": others,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., object],
    args: Sequence[object],
    results: SimpleQueue[tuple[int, bool, bytes | str]],
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    try:
        import torch

        # the rule of every launcher (rank_environment set it before torch started): this
        # thread's count follows it too, as OpenMP's variable gives it
        torch.set_num_threads(threads_per_rank(world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            # plain pickle: torch's queue reducer would pass tensors through shared memory,
            # which is gone once this process exits
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_local(
    fn: Callable[..., T], world_size: int, args: Sequence[object] = (), backend: str = "gloo", timeout: float = 300
) -> list[T]:
    """``[fn(rank, world_size, *args) for each rank]``, computed in ``world_size`` processes.

    ``fn`` must be importable (a module-level function) and return something picklable.
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    # not daemonic: a rank may start processes of its own (a DataLoader's workers); every path
    # below ends them (join, else terminate, else kill)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, results), daemon=False)
        for r in range(world_size)
    ]
    collected: dict[int, T] = {}
    failures: list[tuple[int, str]] = []
    try:
        with _environment(rank_environment(world_size)):  # a spawned rank inherits it as it starts
            for proc in procs:
                proc.start()
        deadline = time.monotonic() + timeout
        while len(collected) + len(failures) < world_size:
            if results.empty():
                if time.monotonic() > deadline or (not any(p.is_alive() for p in procs) and results.empty()):
                    break
                time.sleep(0.02)
                continue
            rank, ok, value = results.get()
            if ok:
                collected[rank] = pickle.loads(value)
            else:
                failures.append((rank, value))
            if failures:
                break  # the other ranks may be blocked in a collective: stop them
    finally:
        for proc in procs:
            if proc.pid is None:
                continue  # never started
            proc.join(timeout=5 if not failures and len(collected) == world_size else 0.5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    if failures:
        rank, tb = failures[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
    if len(collected) < world_size:
        missing = sorted(set(range(world_size)) - set(collected))
        raise TimeoutError(
            f"ranks {missing} of {world_size} did not finish within {timeout}s (or died without a result)"
        )
    return [collected[r] for r in range(world_size)]
