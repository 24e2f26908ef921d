"""The launch conditions a survey run records: each rank's threads, the machine's cores and load as
it started, and the share of the machine other processes used while it trained. Every launcher
records them alike (run_local's ranks, script mode, torchrun and horovodrun), so that no
launcher decides a comparison (the thread rule itself is the library's:
:func:`grace_dgc.launch.threads_per_rank`)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any


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
