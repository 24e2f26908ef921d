"""Run a function on N local ranks, each in its own process with a gloo (or NCCL)
process group on localhost; used by the CLI, the apps on the library and the tests.

Results come back in rank order; a rank that raises makes the whole call raise with its
traceback, and a run that exceeds ``timeout`` is killed rather than left hanging.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, TypeVar

import torch.multiprocessing as mp

from . import environment

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

T = TypeVar("T")


def threads_per_rank(ranks: int) -> int:
    """The intra-op threads each of ``ranks`` ranks on this machine runs with: one rule for
    every launcher (``run_local`` and :class:`RankPool`, and the launchers of the apps on the
    library: their ``local``, torchrun and horovodrun prefixes), so that no launcher decides a comparison. The value
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
    pooled: bool = False,
    store: Any = None,
) -> None:
    """One rank of one job: its process group on ``port`` (rank 0 hosts the store) or on
    ``store``, ``fn``, the process group torn down; the result (or the traceback) put on
    ``results``. ``pooled``: the process lives on after the job (:class:`RankPool`, whose own
    store the job's prefix is), so the job's end is said as a rank's exit would say it."""
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
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        # plain pickle: torch's queue reducer would pass tensors through shared memory,
        # which is gone once this process exits
        outcome: tuple[int, bool, bytes | str] = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        outcome = (rank, False, traceback.format_exc())
    try:
        if pooled:
            from .engines.torch_engine import leave

            leave()  # the job's end is this rank's exit for its ranks: they learn it left, not guess
            _break_subgroups()
        results.put(outcome)
    finally:
        dist.destroy_process_group()


def _break_subgroups() -> None:
    """Destroy the groups a job made beside the default one (grace's own groups), closing their
    connections as the rank's exit would: a rank still in a collective with this one, which has
    finished its job and will never join, fails now rather than at its timeout."""
    import torch.distributed as dist

    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            _best_effort(lambda: dist.destroy_process_group(group))  # noqa: B023 (called at once)


def _best_effort(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:  # the store's host is gone (its job failed there): nothing to wait for
        pass


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """What a rank starts with: ``variables``, and SIGINT ignored (a Ctrl-C reaches the whole
    process group; the launcher, which gets it, stops its ranks, which would each print a
    KeyboardInterrupt traceback). Python sets handlers on the main thread only."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    main = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, handler)
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
    count, default dtype and determinism flag, the fused kernels' mode, and the registries
    (what a job registered is forgotten)."""

    def __init__(self) -> None:
        import random

        import numpy
        import torch

        from . import kernels
        from .registry import _REGISTRIES

        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.torch_rng, self.seed = torch.get_rng_state(), torch.initial_seed()
        self.random, self.numpy = random.getstate(), numpy.random.get_state()
        self.threads, self.dtype = torch.get_num_threads(), torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.kernels = (kernels._mode, kernels.failure)
        self.registries = {registry: registry.snapshot() for registry in _REGISTRIES}

    def restore(self) -> None:
        import random

        import numpy
        import torch

        from . import kernels
        from .registry import _REGISTRIES

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
        for registry in list(_REGISTRIES):  # a plugin a job registered is gone
            if registry in self.registries:
                registry.restore(self.registries[registry])
            else:  # a registry a job imported: as that job left it
                self.registries[registry] = registry.snapshot()


def _pool_worker(
    rank: int,
    world_size: int,
    backend: str,
    jobs: SimpleQueue[tuple[int, Callable[..., object], Sequence[object]] | None],
    results: SimpleQueue[tuple[int, bool, bytes | str]],
    port: int = 0,
) -> None:
    """A pooled rank: job after job as :func:`_worker` runs one, from the same starting state,
    each on its own prefix of the pool's store (hosted by the pool on ``port``: a job's process
    group starts with no store to bring up and no race to connect to it)."""
    import gc

    import torch.distributed as dist

    pool_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    baseline = _Baseline()
    gc.collect()
    gc.freeze()  # what the rank holds before its first job: not traversed again by each job's collect
    while (job := jobs.get()) is not None:
        number, fn, args = job
        baseline.restore()
        store = dist.PrefixStore(f"job{number}/", pool_store)
        _worker(rank, world_size, port, backend, fn, args, results, pooled=True, store=store)
        del store
        gc.collect()  # the job's objects (and the threads they own) go before the next starts
        gc.freeze()  # and what it left for good (modules it imported) is not traversed again


POOL_ENGINES = ("torch", "horovod")


class RankPool:
    """``world_size`` local ranks started once and kept up across jobs: :meth:`run` has
    :func:`run_local`'s contract (results in rank order, a failure raised with its traceback,
    ``timeout`` enforced) without a process start and a torch import per job. Each job starts
    from the state a fresh process starts with (:class:`_Baseline`); a job that fails or
    overruns tears the ranks down, and the next job starts fresh ones.

        with RankPool(2) as pool:
            for cell in cells:
                pool.run(train_cell, (cell,))

    ``engine="torch"``: spawned ranks, each job on a process group of its own (``backend``)
    over a store the pool hosts (a job's set-up and teardown: ~0.02 s on 2 cores);
    ``engine="horovod"``: ranks under ``horovodrun -np N --gloo`` (Horovod is initialised once
    per rank, as a Horovod script does; it cannot start again in one process).
    """

    def __init__(self, world_size: int, backend: str = "gloo", engine: str = "torch") -> None:
        from .errors import check_choice

        check_choice("RankPool engine", engine, POOL_ENGINES)
        self.world_size, self.backend, self.engine = world_size, backend, engine
        self.starts = 0  # how many times ranks were started (1 + one per failed job)
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None
        self._store: Any = None  # the jobs' store (torch engine), hosted here while its ranks are up
        self._jobs_run = 0  # each job's keys go under a prefix of their own

    def _start(self) -> None:
        if self.engine == "horovod":
            self._procs, self._jobs, self._results = _start_horovodrun(self.world_size)
            self.starts += 1
            return
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self._results = ctx.SimpleQueue()
        self._jobs = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, self.world_size, self.backend, self._jobs[r], self._results, self._store.port),
            )
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
        self._jobs_run += 1
        for jobs in self._jobs:
            jobs.put((self._jobs_run, fn, tuple(args)))
        try:
            collected, failures = _collect(self._results, self._procs, self.world_size, timeout)
        except BaseException:  # interrupted (Ctrl-C, a test's time limit): its ranks are mid-job
            self.close(clean=False)
            raise
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
        if isinstance(self._results, _Connections):
            self._results.close()
        self._procs, self._jobs, self._store = [], [], None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the same pool under horovodrun -----------------------------------------------------------

HOROVOD_CONNECT_SECONDS = 120.0  # horovodrun starts its ranks, which import torch and Horovod


class _Connections:
    """Each horovodrun rank's socket, read as :func:`_collect` reads a spawned pool's queue."""

    def __init__(self, connections: Sequence[Connection]) -> None:
        self.connections = list(connections)

    def empty(self) -> bool:
        return not any(conn.poll(0) for conn in self.connections)

    def get(self) -> tuple[int, bool, bytes | str]:
        ready = wait(self.connections)[0]
        return pickle.loads(ready.recv_bytes())  # type: ignore[union-attr]

    def close(self) -> None:
        for conn in self.connections:
            conn.close()


class _Sender:
    """A rank's job channel, with a spawned pool's ``put``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, job: object) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(job))
        except OSError:  # the rank is gone: _collect finds it dead
            pass


class _Launched:
    """horovodrun, seen by :func:`_collect` and :func:`_stop` as each of its ranks: alive while
    it runs; stopping it stops them all."""

    def __init__(self, proc: Any) -> None:
        self.proc, self.pid = proc, proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except Exception:  # subprocess.TimeoutExpired: still running, as Process.join leaves it
            pass

    def terminate(self) -> None:
        if self.is_alive():
            os.killpg(self.proc.pid, 15)

    def kill(self) -> None:
        if self.is_alive():
            os.killpg(self.proc.pid, 9)


def _start_horovodrun(world_size: int) -> tuple[list[Any], list[Any], _Connections]:
    """``horovodrun -np world_size --gloo`` on this host, each rank connected back to this
    process and serving jobs (:func:`_horovod_pool_rank`)."""
    import shutil
    import subprocess
    import sys

    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or shutil.which("horovodrun")
    if horovodrun is None:
        raise RuntimeError("RankPool(engine='horovod') needs horovodrun on PATH (pip install horovod)")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(HOROVOD_CONNECT_SECONDS)
    port = server.getsockname()[1]
    serve = f"from grace_dgc.launch import _horovod_pool_rank; _horovod_pool_rank({port})"
    cmd = [horovodrun, "-np", str(world_size), "--gloo", "-H", f"localhost:{world_size}"]
    cmd += ["--gloo-timeout-seconds", "60", sys.executable, "-c", serve]
    variables = {**os.environ, **rank_environment(world_size)}
    variables.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + variables.get("PATH", ""),
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),  # the caller's modules, as spawn gives them
    )
    # its own process group: stopping horovodrun stops every rank it started
    proc = subprocess.Popen(
        cmd, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    connections: dict[int, Connection] = {}
    try:
        while len(connections) < world_size:
            sock, _ = server.accept()
            sock.settimeout(None)
            conn = Connection(sock.detach())
            connections[pickle.loads(conn.recv_bytes())] = conn
    except OSError as error:
        _Launched(proc).kill()
        output = proc.communicate()[0].decode(errors="replace")[-4000:]
        raise RuntimeError(f"horovodrun's ranks did not connect ({error}):\n{output}") from error
    finally:
        server.close()
    ordered = [connections[r] for r in range(world_size)]
    return [_Launched(proc)] * world_size, [_Sender(c) for c in ordered], _Connections(ordered)


def _horovod_pool_rank(port: int) -> None:
    """A rank under horovodrun: Horovod initialised once, then job after job from the same
    starting state, as :func:`_pool_worker` serves them."""
    import gc

    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")  # a job may form process sets (hierarchical communicators)
    conn = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    conn.send_bytes(pickle.dumps(hvd.rank()))
    baseline = _Baseline()
    gc.collect()
    gc.freeze()  # as _pool_worker does
    while (job := pickle.loads(conn.recv_bytes())) is not None:
        _number, fn, args = job
        baseline.restore()
        try:
            result: tuple[int, bool, bytes | str] = (hvd.rank(), True, pickle.dumps(fn(hvd.rank(), hvd.size(), *args)))
        except BaseException:
            result = (hvd.rank(), False, traceback.format_exc())
        conn.send_bytes(pickle.dumps(result))
        gc.collect()
        gc.freeze()
    hvd.shutdown()
