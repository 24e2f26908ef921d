"""The runs of a survey as the report compares them: one :class:`Group` per method label,
workers and network, holding its seeds' summaries and epoch records (:func:`gather`), and
what every section asks of the groups (the baseline a group is compared with, the workers ×
network combinations, a group's title where the survey varies them)."""

import statistics
from collections.abc import Sequence
from typing import Any

from grace_survey.running.results import Record, latest_summaries

TIME_PARTS = (
    ("compute_s", "compute (fwd+bwd)"),
    ("compress_s", "compress"),
    ("communicate_s", "communicate"),
    ("decompress_s", "decompress"),
)


class Group:
    """The runs of one (method label, workers, network) over its seeds."""

    def __init__(self, label: str, workers: int, network: str) -> None:
        self.label, self.workers, self.network = label, workers, network
        self.runs: list[Record] = []  # summaries
        self.epochs: list[list[Record]] = []  # per run: its epoch records (of the summarised attempt)

    @property
    def name(self) -> str:
        return self.label

    def values(self, key: str) -> list[Any]:
        return [r[key] for r in self.runs if r.get(key) is not None]

    def mean(self, key: str) -> float | None:
        vals = self.values(key)
        return sum(vals) / len(vals) if vals else None

    def mean_std(self, key: str, fmt: str = "{:.4f}") -> str:
        vals = self.values(key)
        if not vals:
            return "n/a"
        if len(vals) == 1:
            return fmt.format(vals[0])
        return f"{fmt.format(statistics.mean(vals))} ± {fmt.format(statistics.stdev(vals))}"

    def curve(self, key: str) -> list[float]:
        """Per-epoch mean over seeds (epochs every run has)."""
        length = min(len(e) for e in self.epochs)
        out = []
        for i in range(length):
            vals = [e[i][key] for e in self.epochs if e[i].get(key) is not None]
            out.append(sum(vals) / len(vals) if vals else float("nan"))
        return out


def gather(records: Sequence[Record]) -> tuple[list[Group], list[Record], list[Record]]:
    """Groups (in first-run order), tuning records, failures without a later success."""
    latest = {r["run_id"]: r for r in latest_summaries(records)}
    epochs_by_attempt: dict[str | None, list[Record]] = {}
    for r in records:
        if r.get("type") == "epoch":
            epochs_by_attempt.setdefault(r.get("attempt"), []).append(r)
    groups: dict[tuple[str, int, str], Group] = {}
    for summary in latest.values():
        key = (summary["label"], summary["workers"], summary.get("network", "local"))
        group = groups.setdefault(key, Group(*key))
        group.runs.append(summary)
        group.epochs.append(sorted(epochs_by_attempt.get(summary.get("attempt"), []), key=lambda e: e["epoch"]))
    tuning: dict[str, Record] = {}
    for r in records:
        if r.get("type") == "tuning":
            tuning[r["tuning_key"]] = r
    failures = [r for r in records if r.get("type") == "error" and r["run_id"] not in latest]
    return list(groups.values()), list(tuning.values()), failures


def combos(groups: Sequence[Group]) -> list[tuple[int, str]]:
    """The (workers, network) combinations of ``groups``, in first-run order."""
    return list(dict.fromkeys((g.workers, g.network) for g in groups))


def peers(groups: Sequence[Group], combo: tuple[int, str]) -> list[Group]:
    """The groups of one (workers, network) combination."""
    return [g for g in groups if (g.workers, g.network) == combo]


def baseline_of(group: Group, groups: Sequence[Group]) -> Group:
    """What ``group`` is compared with: the ``none`` compressor of the same workers and
    network, else the first method there."""
    same = peers(groups, (group.workers, group.network))
    dense = [g for g in same if g.runs and g.runs[0].get("compressor") == "none"]
    return (dense or same)[0]


def group_title(group: Group, groups: Sequence[Group]) -> str:
    """Label, plus workers / network only where the survey varies them."""
    parts = [group.label]
    if len({g.workers for g in groups}) > 1:
        parts.append(f"{group.workers} workers")
    if len({g.network for g in groups}) > 1:
        parts.append(f"@{group.network}")
    return ", ".join(parts) if len(parts) > 1 else parts[0]
