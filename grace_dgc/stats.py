"""What Grace measures, named once: the counters and timers of ``Grace.stats()``, and the
clock that splits a step's time among its phases.

Every consumer (a trainer's logs, a report, a projection) reads these names from here, so a
counter added to Grace is a counter every consumer knows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

# the phases of the data path, each timed exclusively: a phase's seconds exclude those of
# the phases it encloses (decompression inside the exchange counts as decompression)
TIMERS = ("compress", "memory", "communicate", "decompress")
COUNTERS = ("tensors", "groups", "bytes_sent", "bytes_received", "dense_bytes", "skipped")
# the ranks' agreements around the payloads (the settings and fingerprint handshakes, the
# non-finite flags): their own bytes and seconds, apart from the payloads' so that a method's
# bytes_sent stays what its wire format says
CONTROL = ("control_bytes_sent", "control_bytes_received", "control_seconds")
DERIVED = ("steps", "compression_ratio", "bytes_per_step")
# every key Grace.stats() reports itself (a part adds its own, e.g. DGC's current ratio)
WAIT = "wait_seconds"  # the training thread blocked on exchanges (charged by the optimizer wrapper)
GRACE_KEYS = frozenset(COUNTERS + DERIVED + CONTROL + (WAIT,) + tuple(key + "_seconds" for key in TIMERS))

_active = threading.local()  # the clock of the exchange running on this thread, if any


class Clock:
    """Seconds per phase, exclusive of nested phases (see :func:`phase`)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(TIMERS, 0.0)
        self._stack: list[list[float]] = []  # per open phase: [start, seconds of enclosed phases]

    @contextmanager
    def running(self) -> Iterator[Clock]:
        """Make this the clock :func:`phase` charges on this thread (the communication thread
        runs one exchange at a time)."""
        previous, _active.clock = getattr(_active, "clock", None), self
        try:
            yield self
        finally:
            _active.clock = previous

    def timed(self, key: str) -> _Timed:
        """A context that charges its time to ``key`` (less what nested phases charged)."""
        return _Timed(self, key)


class _Timed:
    """One phase of a :class:`Clock` (a plain class: the data path enters several per fusion
    group, and a generator-based context manager costs a few microseconds each)."""

    __slots__ = ("clock", "key", "frame")

    def __init__(self, clock: Clock, key: str) -> None:
        self.clock, self.key = clock, key

    def __enter__(self) -> None:
        self.frame = [time.perf_counter(), 0.0]
        self.clock._stack.append(self.frame)

    def __exit__(self, *exc: object) -> None:
        stack = self.clock._stack
        stack.pop()
        spent = time.perf_counter() - self.frame[0]
        self.clock.seconds[self.key] += spent - self.frame[1]
        if stack:
            stack[-1][1] += spent


def phase(key: str) -> AbstractContextManager[None]:
    """Charge the enclosed time to ``key`` on the running exchange's clock (nothing when a
    communicator or compressor runs outside Grace, e.g. GRACE-style ``exchange`` calls)."""
    clock: Clock | None = getattr(_active, "clock", None)
    return nullcontext() if clock is None else clock.timed(key)
