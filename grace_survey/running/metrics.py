"""What one rank measures in one epoch (:class:`RankTotals`), and the epoch record every
rank derives from all ranks' totals (:func:`epoch_record`). Adding a metric: a field here and
its line in ``epoch_record``."""

import dataclasses
from collections.abc import Sequence
from typing import Any, Self

from grace_survey.running.summary import COMPUTE_S, MEASURED_TIMES, STEP_S, WAIT_S


@dataclasses.dataclass
class RankTotals:
    """One rank's sums over one epoch's steps (gathered as one float64 vector)."""

    loss: float = 0.0  # Σ loss × samples
    hits: float = 0.0  # correct predictions
    count: float = 0.0  # predictions
    bytes_sent: float = 0.0  # grace.stats()["bytes_sent"]
    dense_bytes: float = 0.0  # what an fp32 allreduce would have handed over
    exchanges: float = 0.0  # tensors exchanged
    groups: float = 0.0  # fusion groups exchanged (each one set of collectives)
    timed_steps: float = 0.0  # steps past timing_skip_steps
    train_time: float = 0.0  # epoch wall time (set at the end of the epoch)
    peak_rss_mb: float = 0.0
    peak_gpu_mb: float = 0.0
    compute: float = 0.0  # the timers: seconds over the timed steps
    compress: float = 0.0
    communicate: float = 0.0
    decompress: float = 0.0
    wait: float = 0.0

    TIMERS = ("compute", "compress", "communicate", "decompress", "wait")  # as summary.MEASURED_TIMES

    def as_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> Self:
        return cls(*values)


def epoch_record(
    ranks: Sequence[RankTotals],
    epoch: int,
    lr: float,
    steps: int,
    global_batch: int,
    elapsed: float,
    test_loss: float,
    test_accuracy: float,
    method_stats: dict[str, Any],
) -> dict[str, Any]:
    """The epoch's record from every rank's :class:`RankTotals` (the same on every rank)."""
    n = len(ranks)
    epoch_time = max(r.train_time for r in ranks)
    sent = sum(r.bytes_sent for r in ranks)
    dense = sum(r.dense_bytes for r in ranks)
    count = sum(r.count for r in ranks)
    record: dict[str, Any] = {
        "epoch": epoch,
        "lr": lr,
        "steps": steps,
        "train_loss": sum(r.loss for r in ranks) / count,
        "train_accuracy": sum(r.hits for r in ranks) / count,
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "epoch_time_s": epoch_time,
        "elapsed_s": elapsed + epoch_time,
        "samples_per_s": steps * global_batch / epoch_time,
        "bytes_per_step": sent / n / steps,
        "dense_bytes_per_step": dense / n / steps,
        "compression_ratio": sent / max(dense, 1),
        "exchanges_per_step": ranks[0].exchanges / steps,
        "groups_per_step": ranks[0].groups / steps,
        "timed_steps": int(ranks[0].timed_steps),
        "peak_rss_mb": max(r.peak_rss_mb for r in ranks),
        "peak_gpu_mb": max(r.peak_gpu_mb for r in ranks),
        "method_stats": method_stats,
    }
    for name, key in zip(RankTotals.TIMERS, MEASURED_TIMES, strict=True):  # per-step means over ranks
        record[key] = sum(getattr(r, name) / max(r.timed_steps, 1) for r in ranks) / n
    record[STEP_S] = record[COMPUTE_S] + record[WAIT_S]
    return record
