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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch.multiprocessing as mp

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

T = TypeVar("T")


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

        # ranks share the machine's cores: don't let each spin up a full-size thread pool
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
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
