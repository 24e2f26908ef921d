import math
import os
import threading
import warnings
import weakref
import zlib
from concurrent.futures import Future
from queue import SimpleQueue

import torch
from torch import Tensor

from ..errors import check_range
from ..interfaces import Compressor, Payload
from ..registry import register_compressor
from .sparse import subtract_at_

# Above this kept ratio a permutation of n is cheaper than drawing k distinct indices.
PERMUTATION_RATIO = 0.25
# Draw ahead for CPU tensors too (without the CUDA stream): for the tests, which have no GPU.
_DRAW_AHEAD_ON_CPU = False


def distinct_indices(n: int, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct indices drawn uniformly from ``range(n)`` (every k-subset equally
    likely), ascending, int64, without a permutation of n when k ≤ n/4:

    1. draw m ≥ k indices with replacement (m from the expected number of distinct values
       of m draws, n·(1 − e^(−m/n)), plus a margin); more are drawn if still < k distinct;
    2. U = the distinct values (ascending). Given |U| = u, U is a uniform u-subset (the
       draws are exchangeable), so a uniform k-subset of U is a uniform k-subset of
       range(n): drop u − k of its positions, themselves drawn this way (u − k ≪ k).

    Cost: O(k log k) instead of O(n). Above k = n/4, ``randperm(n)[:k]``, sorted.
    """
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if k > PERMUTATION_RATIO * n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    m = math.ceil(-n * math.log1p(-k / n) * 1.02) + 16
    draws = torch.randint(n, (m,), generator=generator)
    distinct = torch.unique(draws)
    while distinct.numel() < k:  # rare: the margin fell short
        draws = torch.cat([distinct, torch.randint(n, (k,), generator=generator)])
        distinct = torch.unique(draws)
    surplus = distinct.numel() - k
    if not surplus:
        return distinct
    keep = torch.ones(distinct.numel(), dtype=torch.bool)
    keep[distinct_indices(distinct.numel(), surplus, generator)] = False
    return distinct[keep]


def draw_indices(seed: int, compress_ratio: float, name: str, numel: int, step: int) -> Tensor:
    """S_t of tensor ``name`` (``numel`` elements) at ``step``, on the CPU: a function of its
    arguments alone, drawn from a fresh CPU generator (the same bits on every rank and device)."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + step) % 2**63)
    k = max(1, int(numel * compress_ratio)) if numel else 0
    return distinct_indices(numel, k, generator)


# what a draw depends on, and where it goes: (name, numel, step, compress_ratio, seed, device)
Key = tuple[str, int, int, float, int, torch.device]


class _DrawAhead:
    """The next step's indices of each tensor, drawn on a daemon thread while this step goes
    on: the draw depends on its :data:`Key` alone, never on the data. On a GPU the thread puts
    them in pinned memory and copies them on a side stream, recording an event the consumer's
    stream waits on. A prefetch is used only for exactly its key, so a rewound or reset step
    counter, a new size, ratio or device never sees a stale one."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has no thread: it builds its own helper
        self.failed = False  # the thread's first error was reported (a warning, once)
        self._pending: dict[str, tuple[Key, Future[tuple[Tensor, torch.cuda.Event | None]]]] = {}
        self._jobs: SimpleQueue[tuple[Future[tuple[Tensor, torch.cuda.Event | None]], Key] | None] = SimpleQueue()
        threading.Thread(target=_serve, args=(self._jobs,), name="randomk-draw-ahead", daemon=True).start()
        weakref.finalize(self, self._jobs.put, None)  # the thread ends with its helper

    def start(self, key: Key) -> None:
        future: Future[tuple[Tensor, torch.cuda.Event | None]] = Future()
        self._pending[key[0]] = (key, future)
        self._jobs.put((future, key))

    def take(self, key: Key) -> Tensor | None:
        """The indices drawn ahead for ``key``, usable on the current stream; None when there
        are none for that key or the thread failed (the caller then draws them itself)."""
        entry = self._pending.pop(key[0], None)
        if entry is None or entry[0] != key:
            return None
        try:
            indices, event = entry[1].result()
        except Exception as error:
            if not self.failed:
                self.failed = True
                warnings.warn(
                    f"randomk: drawing the indices ahead failed ({type(error).__name__}: {error}); "
                    "they are drawn in the step instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        if event is not None:
            stream = torch.cuda.current_stream(indices.device)
            stream.wait_event(event)
            indices.record_stream(stream)  # allocated on the side stream, freed after this one's use
        return indices


def _serve(jobs: "SimpleQueue[tuple[Future[tuple[Tensor, torch.cuda.Event | None]], Key] | None]") -> None:
    """The draw-ahead thread: draws each job's indices until it gets None."""
    streams: dict[torch.device, torch.cuda.Stream] = {}
    while (job := jobs.get()) is not None:
        future, (name, numel, step, compress_ratio, seed, device) = job
        pinned = event = None
        try:
            indices = draw_indices(seed, compress_ratio, name, numel, step)
            if device.type == "cuda":
                with torch.cuda.device(device):
                    if device not in streams:
                        streams[device] = torch.cuda.Stream(device)
                    stream = streams[device]
                    pinned = indices.pin_memory()
                    with torch.cuda.stream(stream):
                        indices = pinned.to(device, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(stream)
        except BaseException as error:  # the consumer falls back and reports it
            future.set_exception(error)
            continue
        future.set_result((indices, event))
        if event is not None:
            event.synchronize()  # the pinned source stays alive until its copy is done
        del pinned


@register_compressor("randomk")
class RandomKCompressor(Compressor):
    """Random-k sparsification with indices shared by all ranks (Stich et al. 2018):

        S_t = k distinct indices, uniform, drawn from seed ⊕ crc32(name) ⊕ t,   payload = g_{S_t}.

    Every rank draws the same S_t from its own ``torch.Generator`` (the global RNG is not
    touched; :func:`distinct_indices` says how), so only the k values travel and payloads
    are summable (allreduce). On a GPU the next step's S_{t+1} is drawn ahead on a thread
    while the step goes on (:class:`_DrawAhead`): the same bits, off the step's path.
    """

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    summable = True

    SETTINGS = ("compress_ratio", "seed")
    STATE = ("steps",)
    RANK_LOCAL = dict(
        Compressor.RANK_LOCAL,
        _draw_ahead="the next step's indices drawn ahead on a GPU (a function of the settings and "
        "the step counter, used only for the exact step they were drawn for) and the thread drawing them",
    )

    def __init__(self, compress_ratio: float = 0.01, seed: int = 0) -> None:
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)
        self.seed = check_range("seed", seed, 0, kind=int)
        self.steps: dict[str, int] = {}  # name -> how many times that tensor was compressed
        self._draw_ahead: _DrawAhead | None = None  # created at the first compress on a GPU

    def indices(self, name: str, numel: int, step: int) -> Tensor:
        return draw_indices(self.seed, self.compress_ratio, name, numel, step)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, tuple[Tensor, torch.Size]]:
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        flat = tensor.reshape(-1)
        key: Key = (name, flat.numel(), step, self.compress_ratio, self.seed, tensor.device)
        ahead = self._draw_ahead_for(tensor.device)
        indices = ahead.take(key) if ahead is not None else None
        if indices is None:
            indices = self.indices(name, flat.numel(), step).to(tensor.device)
        if ahead is not None:
            ahead.start((name, flat.numel(), step + 1, self.compress_ratio, self.seed, tensor.device))
        return [flat.index_select(0, indices)], (indices, tensor.shape)

    def _draw_ahead_for(self, device: torch.device) -> "_DrawAhead | None":
        """The helper drawing the next indices ahead for tensors on ``device``: on a GPU
        (where the draw and copy of a step's indices cost ~70 copies of the gradient), none on
        a CPU (unless the tests turn :data:`_DRAW_AHEAD_ON_CPU` on)."""
        if device.type != "cuda" and not (device.type == "cpu" and _DRAW_AHEAD_ON_CPU):
            return None
        ahead = self.__dict__.get("_draw_ahead")
        if ahead is None or ahead.pid != os.getpid():
            ahead = self._draw_ahead = _DrawAhead()
        return ahead

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_draw_ahead": None}  # copies and pickles draw afresh

    def decompress(self, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        return self.decompress_into(payload, ctx, payload[0].new_empty(ctx[1]))

    def decompress_into(self, payload: Payload, ctx: tuple[Tensor, torch.Size], out: Tensor) -> Tensor:
        indices, _ = ctx
        out.zero_().view(-1)[indices] = payload[0].to(out.dtype)
        return out

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        return subtract_at_(tensor, [payload[0], ctx[0]])

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        tensor.view(-1).index_fill_(0, ctx[0], 0)
        return tensor

    def sent_mask(self, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        indices, shape = ctx  # the shared index set, a sent zero included
        mask = torch.zeros(torch.Size(shape).numel(), dtype=torch.bool, device=payload[0].device)
        mask[indices] = True
        return mask.view(shape)
