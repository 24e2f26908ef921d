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
    """One rank of one job: its process group on ``port``, ``fn``, the process group torn down;
    the result (or the traceback) put on ``results``."""
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
        collected, failures = _collect(results, procs, world_size, timeout)
    finally:
        _stop(procs, clean=not failures and len(collected) == world_size)
    return _in_rank_order(collected, failures, world_size, timeout)


FAILURE_GRACE_S = 2.0  # how long the other ranks' failures are waited for after a first one


def _collect(
    results: SimpleQueue[tuple[int, bool, bytes | str]], procs: Sequence[Any], world_size: int, timeout: float
) -> tuple[dict[int, Any], list[tuple[int, str]]]:
    """Each rank's result or traceback, until all are in, every rank is gone, or ``timeout``
    passed; after a first failure, 2 s more for the others' (a rank left waiting in a
    collective fails soon after, and the one that failed first need not be first in line)."""
    collected: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    while len(collected) + len(failures) < world_size:
        if results.empty():
            if time.monotonic() > deadline or (not any(p.is_alive() for p in procs) and results.empty()):
                break
            time.sleep(0.02)
            continue
        rank, ok, value = results.get()
        if ok:
            collected[rank] = pickle.loads(value)  # type: ignore[arg-type]
        else:
            failures.append((rank, str(value)))
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    return collected, failures


def _stop(procs: Sequence[Any], clean: bool) -> None:
    """End ``procs``: joined when they finished cleanly, else terminated, else killed."""
    for proc in procs:
        if proc.pid is None:
            continue  # never started
        proc.join(timeout=5 if clean else 0.5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _in_rank_order(
    collected: dict[int, T], failures: list[tuple[int, str]], world_size: int, timeout: float
) -> list[T]:
    if failures:
        others = "".join(f"\n--- rank {rank} ---\n{tb}" for rank, tb in failures[1:])
        rank, tb = failures[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}" + (f"\nand also:{others}" if others else ""))
    if len(collected) < world_size:
        missing = sorted(set(range(world_size)) - set(collected))
        raise TimeoutError(
            f"ranks {missing} of {world_size} did not finish within {timeout}s (or died without a result)"
        )
    return [collected[r] for r in range(world_size)]


class _Baseline:
    """What a fresh rank process starts a job with, taken before a pooled rank's first job and
    put back before each: the environment, the working directory, the RNG states of torch
    (and CUDA's, reseeded as a fresh process seeds them), random and numpy, torch's thread
    count, default dtype and determinism flag, and the fused kernels' mode."""

    def __init__(self) -> None:
        import random

        import numpy
        import torch

        from . import kernels

        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.torch_rng, self.seed = torch.get_rng_state(), torch.initial_seed()
        self.random, self.numpy = random.getstate(), numpy.random.get_state()
        self.threads, self.dtype = torch.get_num_threads(), torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.kernels = (kernels._mode, kernels.failure)

    def restore(self) -> None:
        import random

        import numpy
        import torch

        from . import kernels

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_rng_state(self.torch_rng)
        if torch.cuda.is_initialized():  # as a fresh process finds it: seeded, no cache, no peak
            torch.cuda.manual_seed_all(self.seed)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        random.setstate(self.random)
        numpy.random.set_state(self.numpy)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        kernels._mode, kernels.failure = self.kernels


def _pool_worker(
    rank: int,
    world_size: int,
    backend: str,
    jobs: SimpleQueue[tuple[int, Callable[..., object], Sequence[object]] | None],
    results: SimpleQueue[tuple[int, bool, bytes | str]],
) -> None:
    """A pooled rank: job after job as :func:`_worker` runs one, from the same starting state."""
    import gc

    baseline = _Baseline()
    while (job := jobs.get()) is not None:
        port, fn, args = job
        baseline.restore()
        _worker(rank, world_size, port, backend, fn, args, results)
        gc.collect()  # the job's objects (and the threads they own) go before the next starts


class RankPool:
    """``world_size`` local ranks started once and kept up across jobs: :meth:`run` has
    :func:`run_local`'s contract (results in rank order, a failure raised with its traceback,
    ``timeout`` enforced) without a process start and a torch import per job. Each job gets a
    process group of its own and the state a fresh process starts with (:class:`_Baseline`); a
    job that fails or overruns tears the ranks down, and the next job starts fresh ones.

        with RankPool(2) as pool:
            for cell in cells:
                pool.run(train_cell, (cell,))
    """

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size, self.backend = world_size, backend
        self.starts = 0  # how many times ranks were started (1 + one per failed job)
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.SimpleQueue()
        self._jobs = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_pool_worker, args=(r, self.world_size, self.backend, self._jobs[r], self._results))
            for r in range(self.world_size)
        ]
        with _environment(rank_environment(self.world_size)):
            for proc in self._procs:
                proc.start()
        self.starts += 1

    def run(self, fn: Callable[..., T], args: Sequence[object] = (), timeout: float = 300) -> list[T]:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close(clean=False)
            self._start()
        port = free_port()
        for jobs in self._jobs:
            jobs.put((port, fn, tuple(args)))
        collected, failures = _collect(self._results, self._procs, self.world_size, timeout)
        if failures or len(collected) < self.world_size:
            self.close(clean=False)  # its ranks may be out of step, or stuck in a collective
        return _in_rank_order(collected, failures, self.world_size, timeout)

    def close(self, clean: bool = True) -> None:
        """End the ranks: asked to finish after their job (``clean``), else terminated."""
        if clean:
            for jobs, proc in zip(self._jobs, self._procs):
                if proc.is_alive():
                    jobs.put(None)
        _stop(self._procs, clean=clean)
        self._procs, self._jobs = [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
