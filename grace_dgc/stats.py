"""What Grace measures, named once: the counters and timers of ``Grace.stats()``, and the
clock that splits a step's time among its phases.

Every consumer (a trainer's logs, a report, a projection) reads these names from here, so a
counter added to Grace is a counter every consumer knows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

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


class Tally:
    """What a Grace counts since its last ``reset_stats``: the counters, the phase clock, the
    exchanges per tensor name and the training thread's wait. :meth:`counters` gives them as
    plain numbers (a checkpoint carries them) and :meth:`load` takes them back."""

    def __init__(self) -> None:
        self.values: dict[str, float] = dict.fromkeys(COUNTERS + CONTROL, 0)
        self.clock = Clock()
        self.steps: Counter[str] = Counter()  # exchanges per tensor name
        self.wait_seconds = 0.0

    def group(self, names: Sequence[str], dense_bytes: int) -> None:
        """One fusion group exchanged: its tensors, what fp32 would have sent, a step per name."""
        self.values["groups"] += 1
        self.values["tensors"] += len(names)
        self.values["dense_bytes"] += dense_bytes
        self.steps.update(names)

    def count_exchange(self, numel: int, name: str, sent: int, received: int) -> None:
        """An exchange of ``numel`` elements of ``name`` that ran outside the Grace's data path
        (FSDP2's own reduce-scatter for ``none``): ``sent``/``received`` bytes, one group."""
        self.group([name], numel * 4)
        self.values["bytes_sent"] += sent
        self.values["bytes_received"] += received

    def communicating(self, engine: Any) -> _Moved:
        """The communicate phase: its time, and the bytes ``engine`` moved meanwhile."""
        return _Moved(self, engine, "bytes_sent", "bytes_received", self.clock.timed("communicate"))

    def controlling(self, engine: Any) -> _Moved:
        """An agreement among the ranks (a handshake, the non-finite flags): its bytes and
        seconds counted as ``control_*``, apart from the payloads'."""
        return _Moved(self, engine, "control_bytes_sent", "control_bytes_received", None)

    def counters(self) -> dict[str, Any]:
        return {
            "stats": dict(self.values),
            "seconds": dict(self.clock.seconds),
            "steps": dict(self.steps),
            "wait_seconds": self.wait_seconds,
        }

    def load(self, saved: Mapping[str, Any]) -> None:
        """Restore :meth:`counters` (keys this version does not count are left out)."""
        for key, value in saved.get("stats", {}).items():
            if key in self.values:
                self.values[key] = value
        for key, value in saved.get("seconds", {}).items():
            if key in self.clock.seconds:
                self.clock.seconds[key] = float(value)
        self.steps = Counter({str(name): int(count) for name, count in saved.get("steps", {}).items()})
        self.wait_seconds = float(saved.get("wait_seconds", 0.0))

    def figures(self) -> dict[str, Any]:
        """The counters, each phase's ``<phase>_seconds``, ``wait_seconds`` and the derived
        ``steps``, ``compression_ratio`` and ``bytes_per_step`` (``Grace.stats`` says what each is)."""
        out: dict[str, Any] = dict(self.values)
        out.update({key + "_seconds": seconds for key, seconds in self.clock.seconds.items()})
        out[WAIT] = self.wait_seconds
        out["steps"] = max(self.steps.values(), default=0)
        out["compression_ratio"] = out["bytes_sent"] / out["dense_bytes"] if out["dense_bytes"] else 0.0
        out["bytes_per_step"] = out["bytes_sent"] / out["steps"] if out["steps"] else 0.0
        return out


class _Moved:
    """The bytes an engine moved inside a ``with`` (and its seconds: on the clock's phase, or as
    ``control_seconds``), added to a :class:`Tally`. A plain class: entered several times per group."""

    __slots__ = ("tally", "engine", "sent_key", "received_key", "timed", "sent", "received", "started")

    def __init__(self, tally: Tally, engine: Any, sent_key: str, received_key: str, timed: _Timed | None) -> None:
        self.tally, self.engine, self.timed = tally, engine, timed
        self.sent_key, self.received_key = sent_key, received_key

    def __enter__(self) -> None:
        self.sent, self.received = self.engine.bytes_sent, self.engine.bytes_received
        self.started = time.perf_counter()
        if self.timed is not None:
            self.timed.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.timed is not None:
            self.timed.__exit__()
        else:
            self.tally.values["control_seconds"] += time.perf_counter() - self.started
        values = self.tally.values
        values[self.sent_key] += self.engine.bytes_sent - self.sent
        values[self.received_key] += self.engine.bytes_received - self.received
