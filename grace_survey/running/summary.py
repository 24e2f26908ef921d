"""A run's summary line of results.jsonl, built in one place for built-in workloads and script
mode alike from the run's epoch records and what only its caller knows, and the names of the
per-step time metrics the survey records (``compute_s`` … ``step_s``)."""

from __future__ import annotations

import dataclasses
import datetime
import platform
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

import grace_dgc

if TYPE_CHECKING:
    from grace_survey.config.cell import Cell
    from grace_survey.running.results import Record

# the per-step times (seconds per optimizer step) of an epoch record and a summary line
COMPUTE_S = "compute_s"  # forward + backward (script mode: the step less the wait)
COMPRESS_S = "compress_s"  # grace's compress and memory (error feedback) timers
COMMUNICATE_S = "communicate_s"  # grace's communicate timer
DECOMPRESS_S = "decompress_s"  # grace's decompress timer
WAIT_S = "wait_s"  # the training thread waiting for exchanges (built-in: and the update)
STEP_S = "step_s"  # compute + wait (script mode: the wall time between reports per step)
MEASURED_TIMES = (COMPUTE_S, COMPRESS_S, COMMUNICATE_S, DECOMPRESS_S, WAIT_S)
STEP_TIMES = (*MEASURED_TIMES, STEP_S)  # in the order the records hold them
#: the grace.stats() timers each exchange time sums: error feedback's work counts as
#: compression, as before Grace timed it apart (the projection reads compress_s so)
EXCHANGE_TIMERS: dict[str, tuple[str, ...]] = {
    COMPRESS_S: ("compress_seconds", "memory_seconds"),
    COMMUNICATE_S: ("communicate_seconds",),
    DECOMPRESS_S: ("decompress_seconds",),
}


@dataclasses.dataclass(frozen=True)
class SummaryParts:
    """What only the caller knows of its run, each put where the summary line holds it."""

    setup: Record  # what ran (workload or script, its size and training settings), in the line's order
    steps_per_epoch: int
    target_accuracy: float | None
    samples_per_s: float | None
    compression_ratio: float
    device: str
    backend: str
    engine: str
    started: str
    step_times: Mapping[str, float]  # STEP_TIMES' means over the run (:func:`mean_step_times`)
    timing: str | None = None  # script mode: what its times measure
    launch: Mapping[str, object] | None = None  # built-in workloads: how the ranks were launched
    metrics: Record | None = None  # script mode: the script's own metrics at the last report


def summary_record(head: Record, cell: Cell, epochs: Sequence[Record], parts: SummaryParts) -> Record:
    """The summary line of a run from the head of its lines (``cell.record_head``), its cell,
    its epoch records and ``parts``: the outcome, bytes and memory from the epochs, then the
    software, machine and times of the run."""
    steps = sum(e["steps"] for e in epochs) or 1
    last = epochs[-1]
    sent, dense = byte_totals(epochs)
    return dict(
        head,
        type="summary",
        **cell.summary_fields(),
        **parts.setup,
        epochs=len(epochs),
        steps_per_epoch=parts.steps_per_epoch,
        steps=steps,
        **_outcome(epochs, parts.target_accuracy),
        samples_per_s=parts.samples_per_s,
        bytes_per_step=sent / steps,
        dense_bytes_per_step=dense / steps,
        compression_ratio=parts.compression_ratio,
        exchanges_per_step=last["exchanges_per_step"],
        groups_per_step=last["groups_per_step"],
        peak_rss_mb=max(e["peak_rss_mb"] for e in epochs),
        peak_gpu_mb=max(e["peak_gpu_mb"] for e in epochs),
        device=parts.device,
        backend=parts.backend,
        engine=parts.engine,
        **({} if parts.timing is None else {"timing": parts.timing}),
        **host_fields(),
        **({} if parts.launch is None else {"launch": parts.launch}),
        started=parts.started,
        finished=datetime.datetime.now().isoformat(timespec="seconds"),
        method_stats=last["method_stats"],
        **({} if parts.metrics is None else {"metrics": parts.metrics}),
        shaping=netem_shaping(),
        **{key: parts.step_times[key] for key in STEP_TIMES},
    )


def _outcome(epochs: Sequence[Record], target: float | None) -> Record:
    """The final and best metrics, when the target was reached, and the training time."""
    scored = [e for e in epochs if e["test_accuracy"] is not None]
    reached = None if target is None else next((e for e in scored if e["test_accuracy"] >= target), None)
    last = epochs[-1]
    return {
        "final_test_accuracy": last["test_accuracy"],
        "final_test_loss": last["test_loss"],
        "final_train_accuracy": last["train_accuracy"],
        "final_train_loss": last["train_loss"],
        "best_test_accuracy": max((e["test_accuracy"] for e in scored), default=None),
        "target_accuracy": target,
        "epochs_to_target": reached["epoch"] if reached else None,
        "time_to_target_s": reached["elapsed_s"] if reached else None,
        "train_time_s": last["elapsed_s"],
    }


def byte_totals(epochs: Sequence[Record]) -> tuple[float, float]:
    """(bytes sent, dense bytes) per rank over the run, from the epochs' per-step means."""
    sent = sum(e["bytes_per_step"] * e["steps"] for e in epochs)
    dense = sum(e["dense_bytes_per_step"] * e["steps"] for e in epochs)
    return sent, dense


def mean_step_times(epochs: Sequence[Record], weights: Sequence[float]) -> dict[str, float]:
    """Each of :data:`STEP_TIMES` as its mean per step over ``epochs``, each epoch weighted by
    ``weights`` (the steps it timed)."""
    total = sum(weights) or 1
    return {key: sum(e[key] * w for e, w in zip(epochs, weights)) / total for key in STEP_TIMES}


def host_fields() -> dict[str, str]:
    """The software and machine a run's summary records."""
    return {
        "torch": torch.__version__,
        "grace_dgc": grace_dgc.__version__,
        "host": socket.gethostname(),
        "python": platform.python_version(),
    }


def netem_shaping() -> dict[str, Any] | None:
    """The network shaping this process runs under (None outside a shaped namespace)."""
    from grace_survey.running.netem import current_shaping

    return current_shaping()
