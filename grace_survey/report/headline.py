"""The report's headline, time to the target: each group's :class:`Reach` of the target
metric over its seeds, the methods :func:`ranked` by :data:`RANKING_RULE` within each
workers × network, the :func:`headline_table`, and :func:`retarget`, which measures time and
epochs to another target again from the epoch records."""

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grace_survey.report.grouping import Group, baseline_of, combos, peers
from grace_survey.report.significance import positive_interval, too_few, welch_test
from grace_survey.running.results import Record


def metric_name(run: Mapping[str, Any]) -> str:
    """What the target is on, as the workload measures it on its test split: the summary's
    ``metric`` (else next-token accuracy for a language model, else accuracy), as "test …"."""
    name = str(run.get("metric") or ("next-token accuracy" if run.get("loss") == "lm" else "accuracy"))
    return name if name.startswith("test") else f"test {name}"


def is_language_model(run: Mapping[str, Any]) -> bool:
    return run.get("metric") == "next-token accuracy" or run.get("loss") == "lm"


def target_text(target: float) -> str:
    """A target as the report prints it: 2 decimals where they show it exactly."""
    return f"{target:.2f}" if round(target, 2) == target else f"{target:g}"


def _below(value: float, target: float) -> str:
    """``value`` with 3 decimals, or more where rounding would carry it up to the target."""
    for digits in (3, 4, 5, 6):
        text = f"{value:.{digits}f}"
        if float(text) < target:
            return text
    return repr(value)


class Reach:
    """Time and epochs to the target of one group, over its seeds."""

    def __init__(self, group: Group) -> None:
        reached = [r for r in group.runs if r.get("time_to_target_s") is not None]
        self.seeds = len(group.runs)
        self.times = [float(r["time_to_target_s"]) for r in reached]
        self.epochs = [float(r["epochs_to_target"]) for r in reached if r.get("epochs_to_target") is not None]
        self.target = float(group.runs[0]["target_accuracy"])
        self.best = max(_best_accuracy(r, e) for r, e in zip(group.runs, group.epochs))

    @property
    def tier(self) -> int:
        """0: every seed reached the target; 1: some did; 2: none did."""
        return 0 if len(self.times) == self.seeds else 1 if self.times else 2

    @property
    def mean_time(self) -> float:
        return statistics.mean(self.times) if self.times else float("inf")

    def rank_key(self) -> tuple[int, float, float]:
        if self.tier == 0:
            return 0, self.mean_time, statistics.mean(self.epochs) if self.epochs else 0.0
        if self.tier == 1:
            return 1, -len(self.times) / self.seeds, self.mean_time
        return 2, -self.best, 0.0


def _best_accuracy(run: Record, epochs: Sequence[Record]) -> float:
    if run.get("best_test_accuracy") is not None:
        return float(run["best_test_accuracy"])
    seen = [float(e["test_accuracy"]) for e in epochs if e.get("test_accuracy") is not None]
    return max(seen) if seen else float(run["final_test_accuracy"])


def ranked(groups: Sequence[Group]) -> list[tuple[int, Group, Reach]]:
    """(rank within its workers × network, group, reach), by :data:`RANKING_RULE`."""
    out = []
    for combo in combos(groups):
        reaches = [(g, Reach(g)) for g in peers(groups, combo)]
        reaches.sort(key=lambda pair: pair[1].rank_key())  # stable: ties keep the survey's order
        out += [(i + 1, g, reach) for i, (g, reach) in enumerate(reaches)]
    return out


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds < 1:
        return 1e-3, "ms"
    if seconds < 120:
        return 1.0, "s"
    if seconds < 7200:
        return 60.0, "min"
    return 3600.0, "h"


def mean_and_interval(values: Sequence[float], scale: float = 1.0, unit: str = "") -> tuple[str, str]:
    """(mean, 95% CI) of a positive quantity (a time, an epoch count), in ``unit`` (``scale``
    seconds each): the interval is :func:`positive_interval`'s, or "too few seeds"."""
    suffix = f" {unit}" if unit else ""
    text = f"{float(np.mean(values)) / scale:.2f}{suffix}"
    interval = positive_interval(values)
    if interval is None:
        return text, too_few(len(values))
    return text, f"[{interval[0] / scale:.2f}, {interval[1] / scale:.2f}]{suffix}"


RANKING_RULE = (
    "**Ranking rule** (within each workers × network): first the methods whose every seed reached the "
    "target, by mean time to target (ties: mean epochs); then those that reached it in only some seeds, by "
    "the share of seeds that reached it, then by mean time over those seeds (a mean that leaves out the "
    "seeds that never got there flatters a method, so such a method never ranks above one that got there in "
    "every seed); last, those that never reached it, by the best {metric} any seed had at any epoch. Time is "
    "training wall time (evaluation excluded) to the end of the first epoch at or above the target; mean over "
    "the seeds that reached it, and the 95% confidence interval of its geometric mean (Student t on the log "
    "times, n − 1 degrees of freedom, so it stays above zero), from 3 seeds on. Speed-up = "
    "the baseline's mean time / the method's, shown where both reached the target in every seed; p: Welch's "
    "two-sided t-test of the method's times against the baseline's (the baseline is the `none` compressor of "
    "the same workers and network, else the first method)."
)


def headline_table(groups: Sequence[Group]) -> str:
    """Methods ranked by time to the target metric (see :data:`RANKING_RULE`)."""
    first = groups[0].runs[0]
    metric, target = metric_name(first), target_text(first["target_accuracy"])
    rows = ranked(groups)
    reaches = {id(g): reach for _, g, reach in rows}
    scale, unit = _time_unit(min((reach.mean_time for _, _, reach in rows if reach.times), default=1.0))
    lines = [
        f"| Rank | Method | Workers | Network | Reached the target | Time to {target} {metric} (mean) | 95% CI | "
        f"Epochs to {target} {metric} (mean) | 95% CI | Speed-up vs baseline | p (time vs baseline) | "
        f"Final {metric} (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, g, reach in rows:
        base = baseline_of(g, groups)
        status, time, time_ci, epochs, epochs_ci = _reach_cells(reach, scale, unit)
        speedup, p = _speedup_cells(g, reach, base, reaches[id(base)])
        final = g.mean("final_test_accuracy")
        lines.append(
            f"| {rank} | {g.label} | {g.workers} | {g.network} | {status} | {time} | {time_ci} | {epochs} | "
            f"{epochs_ci} | {speedup} | {p} | {'n/a' if final is None else f'{final:.4f}'} |"
        )
    return "\n".join(lines)


def _reach_cells(reach: Reach, scale: float, unit: str) -> tuple[str, str, str, str, str]:
    """A headline row's status, time to target and its CI, epochs to target and its CI."""
    if reach.tier == 2:
        status = f"never reached (best {_below(reach.best, reach.target)} < target {target_text(reach.target)})"
        return status, "—", "—", "—", "—"
    if reach.tier == 0:
        status = f"all {reach.seeds} seeds" if reach.seeds > 1 else "yes (1 seed)"
    else:
        status = f"{len(reach.times)} of {reach.seeds} seeds reached it"
    time, time_ci = mean_and_interval(reach.times, scale, unit)
    epochs, epochs_ci = mean_and_interval(reach.epochs) if reach.epochs else ("n/a", "n/a")
    if reach.tier == 1:
        time += f" ({len(reach.times)} seeds)"
    return status, time, time_ci, epochs, epochs_ci


def _speedup_cells(group: Group, reach: Reach, base: Group, base_reach: Reach) -> tuple[str, str]:
    """A headline row's speed-up against its baseline and Welch's p on the times."""
    if base is group:
        return ("1.00× (baseline)" if reach.tier == 0 else "(baseline)"), "—"
    if reach.tier == 0 and base_reach.tier == 0 and reach.mean_time > 0:
        ratio = base_reach.mean_time / reach.mean_time
        test = welch_test(reach.times, base_reach.times)
        return f"{ratio:.2f}×" + (" (slower)" if ratio < 1 else ""), "—" if test is None else f"{test[1]:.3g}"
    return "—", "—"


def retarget(groups: Sequence[Group], target: float) -> None:
    """Each run's time and epochs to ``target``, measured again from its epoch records (the
    first epoch whose test metric is at or above it), so that a new target needs no new run."""
    for group in groups:
        for run, epochs in zip(group.runs, group.epochs):
            if not epochs and run.get("target_accuracy") == target:
                continue  # no epoch records (an older survey): the summary's own figures stand
            scored = [e for e in epochs if e.get("test_accuracy") is not None]
            reached = next((e for e in scored if e["test_accuracy"] >= target), None)
            run.update(
                target_accuracy=target,
                epochs_to_target=reached["epoch"] if reached else None,
                time_to_target_s=reached["elapsed_s"] if reached else None,
            )
