"""Scratch buffers reused from call to call.

A fresh full-size temporary costs more than the arithmetic done in it on a CPU (the pages
of every large allocation are faulted in anew: about 5× one ``copy_`` for an fp32 tensor),
so the data path keeps its temporaries here instead of allocating them every step. And the
data path's other questions about its tensors: where the averages go (:func:`outputs_for`,
:func:`apart`), whether a payload shares memory with an input (:func:`shares_storage`), whether
a group is finite (:func:`all_finite`), and a comparison into a mask (:func:`compare`).
"""

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

T = TypeVar("T")


class Workspace:
    """One buffer per (slot, dtype, device), grown to the largest size asked for.

    ``get(slot, numel, dtype, device)`` returns a 1-D view of its first ``numel`` elements,
    valid until the next ``get`` of the same slot: a temporary of one call, never something
    returned to the caller. Memory held: per slot, the largest request so far. A chunk worker
    (:func:`for_chunks`) gets buffers of its own, so chunks run at once never share one.
    Copies and pickles start empty (buffers are not state).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device, int], Tensor] = {}

    def get(self, slot: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        key = (slot, dtype, torch.device(device), _lane_index())
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def like(self, slot: str, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A scratch shaped like ``tensor`` (its dtype unless ``dtype`` is given)."""
        dtype = tensor.dtype if dtype is None else dtype
        return self.get(slot, tensor.numel(), dtype, tensor.device).view(tensor.shape)

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __getstate__(self) -> dict[str, object]:
        return {"_buffers": {}}

    def __repr__(self) -> str:
        return f"Workspace({len(self._buffers)} buffers, {self.nbytes()} bytes)"


CPU_CHUNK = 1 << 19  # elements; a chunk's fp32 temporaries (2 MiB) stay in a core's cache
# torch's own grain (at::internal::GRAIN_SIZE): a smaller op runs on one thread anyway, and
# above it every op is a fork-join region of all intra-op threads (see for_chunks)
PARALLEL_GRAIN = 1 << 15


def chunks(numel: int, device: torch.device | str, multiple: int = 1, largest: int = 0) -> list[tuple[int, int]]:
    """``(start, stop)`` pairs covering ``range(numel)`` in order: chunks of at most
    ``largest`` elements (``CPU_CHUNK`` unless given: a body of many small ops may ask for more)
    and a multiple of ``multiple`` on a CPU, where temporaries of one chunk stay in the cache,
    and at least one per intra-op thread once a tensor is above ``PARALLEL_GRAIN`` (so
    :func:`for_chunks` keeps every core busy without a fork-join per op); one chunk on an
    accelerator, where launches cost more."""
    largest = largest or CPU_CHUNK
    if torch.device(device).type != "cpu" or numel <= PARALLEL_GRAIN and numel <= largest:
        return [(0, numel)] if numel else []
    share = -(-numel // torch.get_num_threads())
    size = min(largest, max(PARALLEL_GRAIN, share))
    size = max(multiple, size // multiple * multiple)
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def for_chunks(
    body: Callable[[int, int], T], numel: int, device: torch.device | str, multiple: int = 1, largest: int = 0
) -> list[T]:
    """``[body(start, stop) for (start, stop) in chunks(numel, device, multiple, largest)]``, the
    chunks run at once on the CPU's workers when there are several.

    Why not torch's own threads: every torch op on a CPU is a fork-join region of its
    intra-op threads, and OpenMP's threads spin at the join waiting for each other. With
    another process computing on the same cores (a data loader, another rank, another job) a
    waiting thread spins while the thread it waits for is off the core, and each region then
    costs a scheduler tick or two instead of microseconds: hundreds of chunk-sized ops per
    call made compression 10–70× slower (measured, ``bench_compressors.py --load``). Here
    each worker runs whole chunks with one intra-op thread (no fork-join at all) and takes
    the next chunk when done, so a descheduled worker delays one chunk, not every op.

    As many workers as torch's intra-op threads (``torch.set_num_threads``,
    ``OMP_NUM_THREADS``: torchrun sets 1 per rank), asked each call; one thread, one chunk,
    an accelerator, or a call from inside a chunk: the chunks run here, in order. ``body``
    must write only its own chunk's part of shared outputs; its workspace buffers are its
    worker's own. Results come back in chunk order; an exception in a chunk is raised here.
    """
    spans = chunks(numel, device, multiple, largest)
    threads = torch.get_num_threads()
    if len(spans) <= 1 or threads <= 1 or _lane_index():
        return [body(start, stop) for start, stop in spans]
    return _POOL.run(body, spans, min(threads, len(spans)))


_lane = threading.local()  # .index: the worker's number (≥ 1) in a chunk worker, else unset


def _lane_index() -> int:
    return getattr(_lane, "index", 0)


class _ChunkPool:
    """Worker threads with one intra-op thread each, started as first needed, kept for the
    process (daemons, idle on a queue: they cost nothing between calls)."""

    def __init__(self) -> None:
        self.tasks: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.workers = 0

    def _grow(self, workers: int) -> None:
        with self.lock:
            started = []
            while self.workers < workers:
                self.workers += 1
                started.append(threading.Event())
                name = f"grace-chunks-{self.workers}"
                threading.Thread(target=self._work, args=(self.workers, started[-1]), name=name, daemon=True).start()
        if started:
            threads = torch.get_num_threads()
            for event in started:
                event.wait()
            # torch.set_num_threads in a worker also sets the default that threads starting
            # later take: give it back (each thread keeps its own count once it has started)
            torch.set_num_threads(threads)

    def _work(self, index: int, started: threading.Event) -> None:
        _lane.index = index
        torch.get_num_threads()  # torch sets a thread's count on its first use: before ours
        torch.set_num_threads(1)
        started.set()
        while True:
            with self.lock:
                while not self.tasks:
                    self.ready.wait()
                call = self.tasks.pop()
            call()

    def run(self, body: Callable[[int, int], T], spans: list[tuple[int, int]], workers: int) -> list[T]:
        """The chunks on ``workers`` threads: the caller (one intra-op thread meanwhile) and
        ``workers − 1`` pool workers, each taking the next chunk when done. The caller works
        too and waits only for chunks a worker has taken, never for a worker to wake up (a
        scheduler tick on a busy machine): a late worker finds nothing left and goes back."""
        self._grow(workers - 1)
        results: list = [None] * len(spans)
        state = {"next": 0, "busy": 0}
        errors: list[BaseException] = []
        idle = threading.Condition(self.lock)

        def runner() -> None:
            while True:
                with self.lock:
                    at = state["next"]
                    if at >= len(spans) or errors:
                        return
                    state["next"], state["busy"] = at + 1, state["busy"] + 1
                try:
                    results[at] = body(*spans[at])
                except BaseException as error:  # handed to the caller below
                    with self.lock:
                        errors.append(error)
                finally:
                    with self.lock:
                        state["busy"] -= 1
                        idle.notify_all()

        with self.lock:
            self.tasks.extend([runner] * (workers - 1))
            self.ready.notify_all()
        threads = torch.get_num_threads()
        _lane.index = CALLER_LANE  # its own scratch, and nested for_chunks run inline
        torch.set_num_threads(1)
        try:
            runner()
        finally:
            torch.set_num_threads(threads)
            del _lane.index
        with self.lock:
            while state["busy"]:
                idle.wait()
        if errors:
            raise errors[0]
        return results


CALLER_LANE = -1  # the calling thread's lane while it runs chunks (pool workers: 1, 2, …)
_POOL = _ChunkPool()


def flat_span(tensors: Sequence[Tensor]) -> Tensor | None:
    """A 1-D tensor over the memory of ``tensors`` when they are contiguous, of one dtype and
    device, and lie back to back in one storage in this order (the views of a fusion
    bucket's flat buffer, or DDP's bucket); else None.

    Called once per fusion group per step, so it reads only addresses: each tensor must
    start where the one before it ends, and the whole span must lie inside the first one's
    storage (allocations do not overlap, so memory inside it is its memory)."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    if len(tensors) == 1:
        return first.view(-1)
    dtype, itemsize = first.dtype, first.element_size()
    start = end = first.data_ptr()
    for tensor in tensors:
        if tensor.dtype is not dtype or tensor.data_ptr() != end or not tensor.is_contiguous():
            return None
        end += tensor.numel() * itemsize
    storage, offset = first.untyped_storage(), first.storage_offset()
    total = (end - start) // itemsize
    if (offset + total) * itemsize > storage.nbytes():
        return None  # adjacent in memory, but another allocation
    return first.new_empty(0).set_(storage, offset, (total,))  # type: ignore[call-overload]  # stub: stride required


# -- the data path's tensors: where the averages go, and whether they are finite -------------
_NUMPY_COMPARE = {"ge": np.greater_equal, "le": np.less_equal, "lt": np.less}


def compare(op: str, tensor: Tensor, value: float, out: Tensor) -> Tensor:
    """``torch.<op>(tensor, value, out=out)`` for ``op`` in ge, le, lt, into the bool tensor
    ``out``. On a CPU, for fp32 and fp64, by numpy's SIMD loop: torch 2.13's CPU comparisons
    into bool take 7–8× as long (512K fp32 elements: ~410 µs against ~55). The same answer:
    both compare in the tensor's dtype (a Python float rounded to it), NaN compares false."""
    if tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64) and out.dtype == torch.bool:
        bound = torch.tensor(value, dtype=tensor.dtype).item()  # rounded as torch rounds it (to ±inf: no warning)
        _NUMPY_COMPARE[op](tensor.detach().numpy(), bound, out=out.numpy())
        return out
    return getattr(torch, op)(tensor, value, out=out)


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """No NaN and no infinity in ``tensors``: one sum per tensor (one read each), their total
    read back in a single host sync per group (on a GPU, a sync per tensor and ``isfinite``'s
    four kernels per sum were most of a dense group's launches); element by element only
    when that total is not finite (finite elements may overflow in a sum)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    if len(tensors) == 1:
        total = tensors[0].sum()
    elif len({t.device for t in tensors}) == 1:
        wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        total = torch.stack([t.sum(dtype=wide) for t in tensors]).sum()
    else:
        return all(all_finite([t]) for t in tensors)
    if math.isfinite(total.item()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def shares_storage(payloads: Sequence[Sequence[Tensor]], tensors: list[Tensor], inplace: bool) -> bool:
    """Does a payload tensor share memory with an input that was not handed over (an
    in-place reduction would then write into the caller's tensor)?"""
    if inplace:
        return False
    inputs = {t.untyped_storage().data_ptr() for t in tensors}
    return any(p.untyped_storage().data_ptr() in inputs for payload in payloads for p in payload)


def outputs_for(tensors: list[Tensor], inplace: bool) -> list[Tensor]:
    """Where the averages go: the handed-over tensors themselves, else (or when one is not
    contiguous) new ones."""
    return [
        t if inplace and t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors
    ]


def apart(output: Tensor, compensated: Tensor, memory: Any) -> Tensor:
    """``output``, or a new tensor when it shares memory with what the memory's ``update``
    reads after the aggregate is written (a plugin memory whose ``compensate`` returned a
    handed-over input); Grace then copies the average back."""
    if memory.identity or output.untyped_storage().data_ptr() != compensated.untyped_storage().data_ptr():
        return output
    return torch.empty(output.shape, dtype=output.dtype, device=output.device)
