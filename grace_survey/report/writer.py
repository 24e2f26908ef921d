"""``grace-dgc report DIR``: report.md with the seeds' tables and PNG plots from a survey's
results.jsonl.

Sections, in order:

1. **Time to the target** (the headline): per workers × network, methods ranked by the mean
   over seeds of the training time to the workload's target metric (test accuracy;
   next-token accuracy for language models), with a 95% CI over seeds, epochs to target
   likewise, the speed-up against the baseline (the dense ``none`` compressor) and Welch's
   p on the times. Methods every seed of which reached the target come first, by mean time;
   then those some seeds of which did ("k of n seeds reached it"), by that share; then
   those that never did ("never reached (best … < target …)"), by best accuracy
   (:data:`RANKING_RULE`, printed under the table).
2. **Throughput, bytes and final accuracy** (the general table): test accuracy mean ± std
   over seeds, perplexity for language models, bytes per step, measured compression ratio,
   time split per step, samples/s, peak memory.
3. **How to read this**: notes computed from the records, each only where its case occurs
   (a sparsifier with a smaller ratio sending more bytes, as DGC's dense small / 1-D tensors
   do; fewer bytes but a slower step on an unshaped loopback; fastest to the target vs most
   accurate at the end; "no significant difference" is not "equal").
4. **Do the seeds support the differences?**: final accuracy CIs and Welch tests against
   the baseline.
5. The methods' settings, the seed001 format (epochs and time to the target, final
   test/train accuracy, compression ratio, gradient update size), the seed000 format
   (``Send k% grads | Accuracy | Loss``) for runs tagged ``kpercent``, the lr-tuning
   outcomes, plots (matplotlib, Agg: test accuracy and loss per epoch, accuracy vs measured
   compression ratio, time split per step as stacked bars), failed runs, definitions.
"""

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from grace_dgc.errors import GraceConfigError
from grace_survey.extras import require
from grace_survey.report.conditions import launch_lines
from grace_survey.running.results import CONFIG_JSON, Record, latest_summaries, read_records
from grace_survey.units import human_bytes, human_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TIME_PARTS = (
    ("compute_s", "compute (fwd+bwd)"),
    ("compress_s", "compress"),
    ("communicate_s", "communicate"),
    ("decompress_s", "decompress"),
)


# -- gathering -----------------------------------------------------------------------------
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


# -- statistics over seeds ----------------------------------------------------------------
ALPHA = 0.05


def _stats() -> ModuleType:
    return require("scipy.stats", "the report's confidence intervals and t-tests")


def confidence_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None]:
    """(mean, half-width) of the Student-t interval; half-width None below 2 values."""
    array = np.asarray(values, dtype=np.float64)
    mean = float(array.mean())
    if len(array) < 2:
        return mean, None
    sem = float(array.std(ddof=1)) / np.sqrt(len(array))
    return mean, float(_stats().t.ppf(0.5 + level / 2, len(array) - 1)) * sem


MIN_SEEDS_FOR_INTERVAL = 3  # below it, an interval from n − 1 ≤ 1 degrees of freedom says nothing useful


def positive_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The Student-t interval of a positive quantity's geometric mean, computed on the log
    scale and mapped back: it stays above zero, as a time or an epoch count does (a plain
    t interval of 2 seeds' times reached −8.4 s). None below MIN_SEEDS_FOR_INTERVAL values."""
    array = np.asarray(values, dtype=np.float64)
    if len(array) < MIN_SEEDS_FOR_INTERVAL or bool((array <= 0).any()):
        return None
    logs = np.log(array)
    half = float(_stats().t.ppf(0.5 + level / 2, len(array) - 1)) * float(logs.std(ddof=1)) / np.sqrt(len(array))
    return float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


def too_few(count: int) -> str:
    return f"too few seeds ({count}; an interval needs {MIN_SEEDS_FOR_INTERVAL})"


def welch_test(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float] | None:
    """(t, p) of Welch's two-sided t-test (unequal variances); None below 2 values a side
    or when both sides are constant."""
    a, b = np.asarray(values, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if len(a) < 2 or len(b) < 2 or (np.ptp(a) == 0 and np.ptp(b) == 0):
        return None
    with warnings.catch_warnings():  # one constant side (equal accuracies): scipy warns, the result holds
        warnings.filterwarnings("ignore", "Precision loss occurred in moment calculation", RuntimeWarning)
        result = _stats().ttest_ind(a, b, equal_var=False)
    return float(result.statistic), float(result.pvalue)


def _baseline(group: Group, groups: Sequence[Group]) -> Group:
    peers = [g for g in groups if (g.workers, g.network) == (group.workers, group.network)]
    dense = [g for g in peers if g.runs and g.runs[0].get("compressor") == "none"]
    return (dense or peers)[0]


def significance_table(groups: Sequence[Group], key: str = "final_test_accuracy") -> str:
    lines = [
        "| Method | Workers | Network | Seeds | Test acc | 95% CI | Baseline | Δ vs baseline | Welch t | p | Verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        values = g.values(key)
        if not values:
            continue
        mean, half = confidence_interval(values)
        low, high = (max(0.0, mean - half), min(1.0, mean + half)) if half is not None else (0.0, 0.0)
        interval = too_few(len(values)) if len(values) < MIN_SEEDS_FOR_INTERVAL else f"[{low:.4f}, {high:.4f}]"
        base = _baseline(g, groups)
        if base is g:
            lines.append(
                f"| {g.label} | {g.workers} | {g.network} | {len(values)} | {mean:.4f} | {interval} | "
                f"(baseline) | — | — | — | — |"
            )
            continue
        reference = base.values(key)
        delta = mean - float(np.mean(reference)) if reference else float("nan")
        test = welch_test(values, reference) if reference else None
        if test is None:
            t, p, verdict = "—", "—", "not testable (needs ≥ 2 seeds each)"
        else:
            t, p = f"{test[0]:.2f}", f"{test[1]:.3g}"
            verdict = ("better" if delta > 0 else "worse") if test[1] < ALPHA else "no significant difference"
        lines.append(
            f"| {g.label} | {g.workers} | {g.network} | {len(values)} | {mean:.4f} | {interval} | "
            f"{base.label} | {delta:+.4f} | {t} | {p} | {verdict} |"
        )
    return "\n".join(lines)


# -- the headline: time to the target ------------------------------------------------------
def metric_name(run: Mapping[str, Any]) -> str:
    """What the target is on, as the workload measures it on its test split: the summary's
    ``metric`` (else next-token accuracy for a language model, else accuracy), as "test …"."""
    name = str(run.get("metric") or ("next-token accuracy" if run.get("loss") == "lm" else "accuracy"))
    return name if name.startswith("test") else f"test {name}"


def is_language_model(run: Mapping[str, Any]) -> bool:
    return run.get("metric") == "next-token accuracy" or run.get("loss") == "lm"


def _target_text(target: float) -> str:
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


def _combos(groups: Sequence[Group]) -> list[tuple[int, str]]:
    return list(dict.fromkeys((g.workers, g.network) for g in groups))


def ranked(groups: Sequence[Group]) -> list[tuple[int, Group, Reach]]:
    """(rank within its workers × network, group, reach), by :data:`RANKING_RULE`."""
    out = []
    for combo in _combos(groups):
        peers = [(g, Reach(g)) for g in groups if (g.workers, g.network) == combo]
        peers.sort(key=lambda pair: pair[1].rank_key())  # stable: ties keep the survey's order
        out += [(i + 1, g, reach) for i, (g, reach) in enumerate(peers)]
    return out


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds < 1:
        return 1e-3, "ms"
    if seconds < 120:
        return 1.0, "s"
    if seconds < 7200:
        return 60.0, "min"
    return 3600.0, "h"


def _interval(values: Sequence[float], scale: float = 1.0, unit: str = "") -> tuple[str, str]:
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
    metric, target = metric_name(first), _target_text(first["target_accuracy"])
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
        base = _baseline(g, groups)
        base_reach = reaches[id(base)]
        if reach.tier == 2:
            status = f"never reached (best {_below(reach.best, reach.target)} < target {_target_text(reach.target)})"
            time, time_ci, epochs, epochs_ci = "—", "—", "—", "—"
        else:
            if reach.tier == 0:
                status = f"all {reach.seeds} seeds" if reach.seeds > 1 else "yes (1 seed)"
            else:
                status = f"{len(reach.times)} of {reach.seeds} seeds reached it"
            time, time_ci = _interval(reach.times, scale, unit)
            epochs, epochs_ci = _interval(reach.epochs) if reach.epochs else ("n/a", "n/a")
            if reach.tier == 1:
                time += f" ({len(reach.times)} seeds)"
        speedup, p = "—", "—"
        if base is g:
            speedup = "1.00× (baseline)" if reach.tier == 0 else "(baseline)"
        elif reach.tier == 0 and base_reach.tier == 0 and reach.mean_time > 0:
            ratio = base_reach.mean_time / reach.mean_time
            speedup = f"{ratio:.2f}×" + (" (slower)" if ratio < 1 else "")
            test = welch_test(reach.times, base_reach.times)
            p = "—" if test is None else f"{test[1]:.3g}"
        final = g.mean("final_test_accuracy")
        lines.append(
            f"| {rank} | {g.label} | {g.workers} | {g.network} | {status} | {time} | {time_ci} | {epochs} | "
            f"{epochs_ci} | {speedup} | {p} | {'n/a' if final is None else f'{final:.4f}'} |"
        )
    return "\n".join(lines)


# -- how to read this ---------------------------------------------------------------------
def _peers(groups: Sequence[Group], combo: tuple[int, str]) -> list[Group]:
    return [g for g in groups if (g.workers, g.network) == combo]


def _nominal_ratio(group: Group) -> float | None:
    value = (group.runs[0].get("params") or {}).get("compress_ratio")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _last_epoch_bytes(group: Group) -> float | None:
    last = [e[-1]["bytes_per_step"] for e in group.epochs if e and e[-1].get("bytes_per_step") is not None]
    return statistics.mean(last) if last else None


def _dgc_setting(params: Mapping[str, Any], name: str) -> Any:
    """A DGC setting as the run had it: its parameter, else the compressor's default."""
    if name in params:
        return params[name]
    from grace_dgc.compressors.dgc import DGCCompressor

    return inspect.signature(DGCCompressor).parameters[name].default


def _explain_bytes(groups: Sequence[Group]) -> list[str]:
    """(a) a method that keeps a smaller share of the gradient but sends more bytes."""
    out = []
    for combo in _combos(groups):
        sparse = [
            g for g in _peers(groups, combo) if _nominal_ratio(g) is not None and g.mean("bytes_per_step") is not None
        ]
        for a in sparse:
            for b in sparse:
                ra, rb = _nominal_ratio(a), _nominal_ratio(b)
                ba, bb = _bytes(a), _bytes(b)
                if ra is None or rb is None or not (ra < rb and ba > bb):
                    continue
                text = (
                    f"**{a.label} sends more bytes than {b.label}**, though it keeps a smaller share of each "
                    f"gradient ({ra:g} against {rb:g}): measured {human_bytes(ba)} per step per worker "
                    f"(compression ratio {a.mean('compression_ratio'):.4g}) against {human_bytes(bb)} "
                    f"({b.mean('compression_ratio'):.4g})."
                )
                params = a.runs[0].get("params") or {}
                if a.runs[0].get("compressor") == "dgc":
                    text += _dgc_reasons(a, params, ra)
                else:
                    text += " Measured bytes count the whole wire format: indices, headers and any tensor sent whole."
                out.append(text)
    return out


def _dgc_reasons(group: Group, params: Mapping[str, Any], ratio: float) -> str:
    """Why a DGC run sent more than its ratio: warm-up and the tensors it sends whole."""
    text = ""
    warmup = params.get("warmup_epochs") or params.get("warmup_steps")
    last = _last_epoch_bytes(group)
    if warmup and last is not None:
        what = "epochs" if params.get("warmup_epochs") else "steps"
        text += (
            f" Part of it is warm-up: the run average counts {warmup} warm-up {what} of denser exchanges; "
            f"after them, in the last epoch, it still sent {human_bytes(last)} per step."
        )
    rules = []
    if _dgc_setting(params, "dense_1d"):
        rules.append("tensors of dim ≤ 1 (biases, norm weights)")
    minimum = _dgc_setting(params, "min_compress_size")
    if minimum:
        rules.append(f"tensors of fewer than {minimum} elements")
    if not rules:
        return text
    width = "fp16" if _dgc_setting(params, "fp16_values") else "fp32"
    text += f" DGC sends {' and '.join(rules)} whole, in {width}"
    dense = group.mean("dense_bytes_per_step")
    sent = last if last is not None else group.mean("bytes_per_step")
    if dense and sent and sent > 4 * ratio * dense:  # values + indices of the kept share are at most 2×
        share = ratio * dense
        text += (
            f": {ratio:g} of the {human_bytes(dense)} dense gradient is {human_bytes(share)}, so most of the "
            f"{human_bytes(sent)} it sends per step ({sent / share:.3g}×) is those whole tensors, which on a small "
            f"model ({group.runs[0].get('parameters', '?')} parameters) outweigh what the ratio saves."
        )
    else:
        text += "."
    return text


def _bytes(group: Group) -> float:
    value = group.mean("bytes_per_step")
    return float("nan") if value is None else value


def _unshaped(group: Group) -> bool:
    return all(not r.get("bandwidth_bps") and not r.get("latency_ms") for r in group.runs)


def _explain_loopback(groups: Sequence[Group]) -> list[str]:
    """(b) fewer bytes but no faster step, on an unshaped loopback."""
    out = []
    for combo in _combos(groups):
        peers = _peers(groups, combo)
        base = _baseline(peers[0], groups)
        if not _unshaped(base) or base.mean("step_s") is None:
            continue
        slower = [
            g
            for g in peers
            if g is not base
            and _unshaped(g)
            and _bytes(g) < _bytes(base)
            and g.mean("step_s") is not None
            and g.mean("step_s") >= base.mean("step_s")  # type: ignore[operator]
        ]
        if not slower:
            continue
        cases = "; ".join(
            f"{g.label} sends {_bytes(base) / max(_bytes(g), 1e-9):.3g}× fewer bytes ({human_bytes(_bytes(g))}) "
            f"in {_ms(g.mean('communicate_s'))} ms of communication, spends {_ms(g.mean('compress_s'))} ms "
            f"compressing and {_ms(g.mean('decompress_s'))} ms decompressing, and its step takes "
            f"{_ms(g.mean('step_s'))} ms"
            for g in slower
        )
        where = f" ({combo[0]} workers, {combo[1]})" if len(_combos(groups)) > 1 else ""
        out.append(
            f"**Fewer bytes did not make a step faster here{where}.** These runs used an unshaped local loopback, "
            f"where moving bytes costs almost nothing: {base.label} sends {human_bytes(_bytes(base))} per step "
            f"in {_ms(base.mean('communicate_s'))} ms of communication and its step takes "
            f"{_ms(base.mean('step_s'))} ms. Against that, {cases}. Bytes turn into time only where the network "
            "is the bottleneck: rerun with `--bandwidth`, or model larger clusters with `grace-dgc project`."
        )
    return out


def _explain_final_vs_time(groups: Sequence[Group]) -> list[str]:
    """(c) the fastest to the target is not the most accurate at the end, or a seed reached the
    target and ended below it."""
    out: list[str] = []
    if groups[0].runs[0].get("target_accuracy") is None:  # no target: nothing reached it first
        return out
    rows = ranked(groups)
    for combo in _combos(groups):
        peers = [(rank, g, reach) for rank, g, reach in rows if (g.workers, g.network) == combo]
        scored = [(rank, g, reach) for rank, g, reach in peers if g.mean("final_test_accuracy") is not None]
        if not scored:
            continue
        first = scored[0]
        best = max(scored, key=lambda row: row[1].mean("final_test_accuracy") or 0.0)
        metric = metric_name(first[1].runs[0])
        if best[1] is not first[1] and first[2].tier < 2:
            out.append(
                f"**Fastest to the target is not most accurate at the end.** {first[1].label} ranks first "
                f"(reaches {_target_text(first[2].target)} {metric} first) yet ends at "
                f"{first[1].mean('final_test_accuracy'):.4f}; {best[1].label} ranks {best[0]} and ends at "
                f"{best[1].mean('final_test_accuracy'):.4f}. The headline answers how fast a method gets to a "
                f"fixed {metric}; the final {metric} (the throughput table, the seed statistics) answers where "
                f"it stands after {first[1].runs[0].get('epochs', '?')} epochs. They are different questions."
            )
        dropped = [
            (
                g,
                sum(
                    1
                    for r in g.runs
                    if r.get("time_to_target_s") is not None and r["final_test_accuracy"] < reach.target
                ),
            )
            for _, g, reach in peers
        ]
        dropped = [(g, n) for g, n in dropped if n]
        if dropped:
            listing = ", ".join(f"{g.label} ({n} of {len(g.runs)} seeds)" for g, n in dropped)
            out.append(
                f"**Reached the target, then ended below it:** {listing}. {metric.capitalize()} moves from epoch to "
                "epoch; the headline counts the first epoch at or above the target, the final figures the last."
            )
    return out


def _difference_interval(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float] | None:
    """95% CI of mean(values) − mean(baseline), Welch–Satterthwaite degrees of freedom."""
    a, b = np.asarray(values, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return None
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(_stats().t.ppf(1 - ALPHA / 2, df)) * float(np.sqrt(va + vb))
    delta = float(a.mean() - b.mean())
    return delta - half, delta + half


def _explain_not_significant(groups: Sequence[Group], key: str = "final_test_accuracy") -> list[str]:
    """(d) "no significant difference" is not "equal"; one seed supports no claim."""
    cases, untestable = [], []
    for g in groups:
        base = _baseline(g, groups)
        if base is g:
            continue
        values, reference = g.values(key), base.values(key)
        test = welch_test(values, reference) if values and reference else None
        if test is None:
            if values and reference and (len(values) < 2 or len(reference) < 2):
                untestable.append(g.label)
            continue
        interval = _difference_interval(values, reference)
        if test[1] >= ALPHA and interval is not None:
            delta = float(np.mean(values) - np.mean(reference))
            cases.append(f"{g.label} − {base.label}: {delta:+.4f}, 95% CI [{interval[0]:+.4f}, {interval[1]:+.4f}]")
    out = []
    if cases:
        seeds = sorted({len(g.runs) for g in groups})
        n = "/".join(map(str, seeds))
        out.append(
            f'**"No significant difference" means not shown different, not equal.** With {n} seeds a test '
            f"only detects large differences; the final {metric_name(groups[0].runs[0])} differences the seeds "
            f"could not tell apart from zero still allow these ranges: {'; '.join(cases)}. A difference inside "
            "the interval is as consistent with the data as no difference."
        )
    if untestable:
        out.append(
            f"**One seed supports no claim:** {', '.join(untestable)} (or its baseline) ran one seed, so no test "
            "could be made; add seeds to compare them."
        )
    return out


def explanations(groups: Sequence[Group]) -> list[str]:
    """The "How to read this" bullets: each only where its case is in the data."""
    return (
        _explain_bytes(groups)
        + _explain_loopback(groups)
        + _explain_final_vs_time(groups)
        + _explain_not_significant(groups)
    )


# -- tables --------------------------------------------------------------------------------
def _group_title(group: Group, groups: Sequence[Group]) -> str:
    """Label, plus workers / network only where the survey varies them."""
    parts = [group.label]
    if len({g.workers for g in groups}) > 1:
        parts.append(f"{group.workers} workers")
    if len({g.network for g in groups}) > 1:
        parts.append(f"@{group.network}")
    return ", ".join(parts) if len(parts) > 1 else parts[0]


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.2f}"


def general_table(groups: Sequence[Group]) -> str:
    """Throughput, bytes and the final figures (perplexity too where a workload is a language model)."""
    lm = any(is_language_model(r) for g in groups for r in g.runs)
    lines = [
        "| Method | Workers | Network | Seeds | Test acc (mean ± std) | Test loss | "
        + ("Loss gap to baseline (nats) | Perplexity | " if lm else "")
        + "Bytes/step/worker | Compression ratio | Compute ms | Compress ms | Communicate ms | Decompress ms | "
        "Step ms | Samples/s | Peak RSS |",
        "|---|---|---|---|---|---|" + ("---|---|" if lm else "") + "---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        rss = g.mean("peak_rss_mb")
        gpu = g.mean("peak_gpu_mb")
        memory = f"{rss:.0f} MB" + (f" (GPU {gpu:.0f} MB)" if gpu else "")
        perplexity = ""
        if lm:
            perplexity = f"{loss_gap(g, groups)} | {_perplexity(g)} | "
        lines.append(
            f"| {g.label} | {g.workers} | {g.network} | {len(g.runs)} | {g.mean_std('final_test_accuracy')} | "
            f"{g.mean_std('final_test_loss')} | {perplexity}{human_bytes(g.mean('bytes_per_step'))} | "
            f"{g.mean('compression_ratio'):.4g} | {_ms(g.mean('compute_s'))} | {_ms(g.mean('compress_s'))} | "
            f"{_ms(g.mean('communicate_s'))} | {_ms(g.mean('decompress_s'))} | {_ms(g.mean('step_s'))} | "
            f"{_rate(g.mean('samples_per_s'))} | {memory} |"
        )
    return "\n".join(lines)


def loss_gap(group: Group, groups: Sequence[Group]) -> str:
    """Mean final test loss minus the baseline's (same workers and network), in nats, with
    the 95% CI of the difference where both ran enough seeds: how far above dense a language
    model ends, the figure an accuracy hides. Runs of one seed start from the same weights and
    see the same batches, so where both ran the same seeds the interval is the paired one
    (Student t on the per-seed differences), else Welch's."""
    base = _baseline(group, groups)
    if base is group:
        return "(baseline)"
    mine = {r.get("seed"): r["final_test_loss"] for r in group.runs if r.get("final_test_loss") is not None}
    theirs = {r.get("seed"): r["final_test_loss"] for r in base.runs if r.get("final_test_loss") is not None}
    if not mine or not theirs:
        return "—"
    gap = statistics.mean(mine.values()) - statistics.mean(theirs.values())
    if min(len(mine), len(theirs)) < MIN_SEEDS_FOR_INTERVAL:
        return f"{gap:+.3f} ({too_few(min(len(mine), len(theirs)))})"
    if set(mine) == set(theirs) and None not in mine:
        differences = np.asarray([mine[seed] - theirs[seed] for seed in mine], dtype=np.float64)
        half = float(_stats().t.ppf(1 - ALPHA / 2, len(differences) - 1)) * float(
            differences.std(ddof=1) / np.sqrt(len(differences))
        )
        return f"{gap:+.3f} [{gap - half:+.3f}, {gap + half:+.3f}] paired"
    interval = _difference_interval(list(mine.values()), list(theirs.values()))
    return f"{gap:+.3f}" + ("" if interval is None else f" [{interval[0]:+.3f}, {interval[1]:+.3f}]")


def _perplexity(group: Group) -> str:
    """exp(final test loss) per seed, mean ± std over seeds (n/a for a non-language-model)."""
    values = [
        math.exp(r["final_test_loss"])
        for r in group.runs
        if is_language_model(r) and r.get("final_test_loss") is not None
    ]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def target_table(groups: Sequence[Group]) -> str:
    """The seed001 table: epochs and time to the target accuracy and the final figures."""
    target = groups[0].runs[0]["target_accuracy"]
    epochs = max(r["epochs"] for g in groups for r in g.runs)
    pct = f"{target * 100:g}%"
    lines = [
        f"| Model | Epochs to {pct} | Time to {pct} | Test acc (after {epochs} epochs) | "
        f"Train acc (after {epochs} epochs) | Compression ratio | Gradient update size |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        reached = g.values("epochs_to_target")
        if len(reached) == len(g.runs):
            ep = f"{statistics.mean(reached):g} epochs"
            tt = human_seconds(g.mean("time_to_target_s"))
        elif reached:
            ep = f"{statistics.mean(reached):g} epochs ({len(reached)}/{len(g.runs)} seeds)"
            tt = human_seconds(g.mean("time_to_target_s"))
        else:
            ep, tt = "not reached", "—"
        lines.append(
            f"| {_group_title(g, groups)} | {ep} | {tt} | "
            f"{_pct(g.mean('final_test_accuracy'))} | {_pct(g.mean('final_train_accuracy'))} | "
            f"{g.mean('compression_ratio'):.4g} | {human_bytes(g.mean('bytes_per_step'))} |"
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


def kpercent_tables(groups: Sequence[Group]) -> list[str]:
    """The seed000 tables, one per worker count, for runs tagged with ``kpercent``."""
    tagged = [g for g in groups if "kpercent" in g.runs[0].get("tags", {})]
    out = []
    for workers, network in dict.fromkeys((g.workers, g.network) for g in tagged):
        rows = sorted(
            (g for g in tagged if (g.workers, g.network) == (workers, network)),
            key=lambda g: -g.runs[0]["tags"]["kpercent"],
        )
        title = "Single node" if workers == 1 else f"Multi node — {workers} nodes"
        if network != "local":
            title += f" @{network}"
        lines = [f"{title} ({rows[0].runs[0]['workload']})", "", "| Send k% grads | Accuracy | Loss |", "|---|---|---|"]
        for g in rows:
            k = g.runs[0]["tags"]["kpercent"]
            name = "100 (send all)" if k == 100 else "0 (send none)" if k == 0 else f"{k:g}"
            lines.append(f"| {name} | {g.mean_std('final_test_accuracy')} | {g.mean_std('final_test_loss')} |")
        out.append("\n".join(lines))
    return out


def tuning_table(tuning: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| Method | Workers | Network | Candidates: held-out accuracy | Chosen lr |", "|---|---|---|---|---|"]
    for t in tuning:
        cands = ", ".join(
            f"{c['lr']:g}: {c['heldout_accuracy']:.4f}"
            if c.get("heldout_accuracy") is not None
            else f"{c['lr']:g}: diverged"
            for c in t["candidates"]
        )
        lines.append(f"| {t['label']} | {t['workers']} | {t['network']} | {cands} | {t['chosen_lr']:g} |")
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------
def _plt() -> ModuleType:
    """matplotlib.pyplot on the Agg backend."""
    matplotlib = require("matplotlib", "the survey's plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: ModuleType, fig: "Figure", path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(groups: Sequence[Group], path: str) -> str:
    plt = _plt()
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    for g in groups:
        acc, loss = g.curve("test_accuracy"), g.curve("test_loss")
        epochs = list(range(1, len(acc) + 1))
        title = _group_title(g, groups)
        ax_acc.plot(epochs, acc, marker="o", ms=3, label=title)
        ax_loss.plot(epochs, loss, marker="o", ms=3, label=title)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy per epoch")
    ax_loss.set(xlabel="epoch", ylabel="test loss", title="Test loss per epoch")
    if any(v > 0 for g in groups for v in g.curve("test_loss") if v == v):
        ax_loss.set_yscale("log")
    ax_acc.legend(fontsize=7, ncol=1 + len(groups) // 12)
    return _save(plt, fig, path)


def plot_accuracy_vs_ratio(groups: Sequence[Group], path: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for g in groups:
        accs = g.values("final_test_accuracy")
        ratio = g.mean("compression_ratio")
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        ax.errorbar([ratio], [statistics.mean(accs)], yerr=[std], fmt="o", capsize=3, label=_group_title(g, groups))
        ax.annotate(g.label, (ratio, statistics.mean(accs)), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set(
        xlabel="measured compression ratio (bytes sent / dense fp32 bytes)",
        ylabel="final test accuracy",
        title="Accuracy vs measured compression ratio",
    )
    ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, path)


def plot_time_split(groups: Sequence[Group], path: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(groups) + 2), 4.5))
    names = [_group_title(g, groups) for g in groups]
    bottom = [0.0] * len(groups)
    for key, legend in TIME_PARTS:
        heights = [(g.mean(key) or 0.0) * 1000 for g in groups]
        ax.bar(names, heights, bottom=bottom, label=legend)
        bottom = [b + h for b, h in zip(bottom, heights)]
    steps = [(g.mean("step_s") or 0.0) * 1000 for g in groups]
    ax.scatter(names, steps, color="black", marker="_", s=400, zorder=3, label="step wall time")
    ax.set(ylabel="ms per step", title="Time split per step (exchanges may overlap compute)")
    ax.tick_params(axis="x", labelrotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


# -- the report ----------------------------------------------------------------------------
DEFINITIONS = """\
- **Test acc / loss**: after the last epoch, on the workload's test split (mean ± sample std over seeds).
- **Bytes/step/worker**: bytes one worker handed to collectives per optimizer step, measured by
  `grace.stats()` (payload padding and size headers included), mean over workers and steps.
- **Compression ratio**: Σ bytes sent / Σ bytes a dense fp32 exchange of the same gradients would send
  (1 = dense; 0.001 = a thousandth).
- **Compute**: forward + backward wall time per step on the training thread. **Compress / Communicate /
  Decompress**: grace's timers on its communication thread (exchanges start during backward, so they can
  overlap compute). **Step**: forward start to parameter update done (compute + waiting for the exchanges +
  the update). The first `timing_skip_steps` steps of each run are left out of these means.
- **Epochs / time to target**: the first epoch whose test accuracy reaches the target, and the training
  wall time (evaluation excluded) until the end of that epoch.
- **Speed-up**: the baseline's mean time to target / the method's (above 1: faster than the baseline).
- **Samples/s**: global samples per second of training wall time. **Peak RSS**: the largest peak resident
  memory over the ranks, each rank's own since its training started (Linux `VmHWM`; GPU:
  `torch.cuda.max_memory_allocated`)."""


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


def write_report(out_dir: str, report_dir: str | None = None, target: float | None = None) -> str:
    """Write report.md and the PNGs; returns the report's path. The headline's target is
    ``target`` when given, else the survey's current one (its config.json: a target changed
    since the runs finished applies without running them again), else the runs' own."""
    records = read_records(out_dir)
    groups, tuning, failures = gather(records)
    if not groups:
        raise GraceConfigError(
            f"no finished runs in {out_dir!r} (results.jsonl has no summary lines); "
            f"run `grace-dgc survey ... --out {out_dir}` first"
        )
    _stats()  # an optional dependency: missing, nothing is written
    report_dir = report_dir or out_dir
    os.makedirs(report_dir, exist_ok=True)
    config: dict[str, Any] = {}
    if os.path.isfile(os.path.join(out_dir, CONFIG_JSON)):
        with open(os.path.join(out_dir, CONFIG_JSON)) as f:
            config = json.load(f)
    target = target if target is not None else config.get("target_accuracy")
    if target is not None:
        retarget(groups, float(target))
    first = groups[0].runs[0]
    plots = {
        "accuracy_loss.png": plot_curves,
        "accuracy_vs_ratio.png": plot_accuracy_vs_ratio,
        "time_split.png": plot_time_split,
    }
    for name, fn in plots.items():
        fn(groups, os.path.join(report_dir, name))

    name = config.get("name") or first.get("survey") or "survey"
    parts = [f"# Survey report: {name}", ""]
    if config.get("description"):
        parts += [config["description"], ""]
    seeds = sorted({r["seed"] for g in groups for r in g.runs})
    parts += [
        f"- Workload: **{first['workload']}** — {first.get('workload_description', '')}",
        f"- Workers: {', '.join(str(w) for w in sorted({g.workers for g in groups}))}; seeds: "
        f"{', '.join(map(str, seeds))}; {_setup_text(first)}",
        f"- Device: {first.get('device')}, backend {first.get('backend')}, torch {first.get('torch')}, "
        f"host {first.get('host')}",
        *launch_lines([r for g in groups for r in g.runs]),
        "",
    ]
    if first.get("target_accuracy") is None:  # a workload or script without a target
        parts += [
            "## Time to the target",
            "",
            f"No target {metric_name(first)} was set (`target_accuracy` in the config or the workload), so no time "
            "to target was measured; the methods are compared by final accuracy and throughput below.",
            "",
        ]
    else:
        parts += [
            f"## Time to {metric_name(first)} {_target_text(first['target_accuracy'])} (the headline)",
            "",
            headline_table(groups),
            "",
            RANKING_RULE.format(metric=metric_name(first)),
            "",
        ]
    parts += [
        "## Throughput, bytes and final accuracy",
        "",
        general_table(groups),
        "",
    ]
    notes = explanations(groups)
    if notes:
        parts += ["## How to read this", ""] + [f"- {note}" for note in notes] + [""]
    parts += [
        "## Do the seeds support the differences?",
        "",
        "Test accuracy: mean and 95% confidence interval over seeds (Student t, n−1 degrees of freedom, "
        "clipped to [0, 1]; from 3 seeds on); "
        "Welch's t-test against the baseline of the same workers and network (the `none` compressor, else "
        "the first method). A difference is called only at p < 0.05; one seed supports no claim.",
        "",
        significance_table(groups),
        "",
        "## Methods",
        "",
        "| Method | Compressor | Memory | Communicator | Parameters | lr |",
        "|---|---|---|---|---|---|",
    ]
    for g in dict((g.label, g) for g in groups).values():
        r = g.runs[0]
        params = ", ".join(f"{k}={v}" for k, v in r.get("params", {}).items()) or "—"
        lrs = sorted({x["lr"] for x in g.runs if x.get("lr") is not None})
        lr = ", ".join(f"{x:g}" for x in lrs if x is not None) or "the script's"
        lr += " (tuned)" if r.get("lr_tuning") else ""
        parts.append(f"| {g.label} | {r['compressor']} | {r['memory']} | {r['communicator']} | {params} | {lr} |")
    parts.append("")
    if first.get("target_accuracy") is not None:
        parts += [
            f"## Epochs and time to {first['target_accuracy'] * 100:g}% (the seed001 format)",
            "",
            target_table(groups),
            "",
        ]
    kp = kpercent_tables(groups)
    if kp:
        parts += ["## Send k% of the gradient (the seed000 format)", ""]
        for table in kp:
            parts += [table, ""]
    if tuning:
        parts += ["## Learning-rate tuning (best held-out accuracy)", "", tuning_table(tuning), ""]
    parts += [
        "## Plots",
        "",
        "![Test accuracy and loss per epoch](accuracy_loss.png)",
        "",
        "![Accuracy vs measured compression ratio](accuracy_vs_ratio.png)",
        "",
        "![Time split per step](time_split.png)",
        "",
    ]
    if failures:
        parts += ["## Failed runs", ""]
        parts += [
            f"- `{f['run_id']}`: {f['message'].strip().splitlines()[-1] if f['message'].strip() else '?'}"
            for f in failures
        ]
        parts.append("")
    definitions = DEFINITIONS
    if any(is_language_model(r) for g in groups for r in g.runs):
        definitions += (
            "\n- **Loss gap to baseline** (language models): mean final test loss minus the baseline's (the `none` "
            "compressor of the same workers and network), in nats, with the 95% CI of the difference: paired over "
            "seeds where both ran the same seeds (same initial weights and batches), else Welch's."
            "\n- **Perplexity** (language models): exp(final test loss) per seed, mean ± std over seeds."
        )
    parts += ["## Definitions", "", definitions, ""]
    path = os.path.join(report_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def add_report_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("dir", help="a survey output directory (with results.jsonl)")
    parser.add_argument("--out", help="where to write report.md and the PNGs (default: DIR)")
    parser.add_argument(
        "--target",
        type=float,
        help="the target test metric of the headline (e.g. 0.9), measured from the runs' epochs: nothing runs again "
        "(default: the survey's target_accuracy)",
    )
    return parser


def run_report(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        raise GraceConfigError(f"{args.dir!r} is not a directory")
    path = write_report(args.dir, args.out, args.target)
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_report(add_report_args(argparse.ArgumentParser(prog="grace-dgc report")).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def _setup_text(first: Record) -> str:
    """Epochs, batch and optimizer of the runs; a script-mode run's are its script's."""
    text = f"epochs: {first['epochs']} ({first['steps_per_epoch']} steps each"
    if first.get("script"):
        batch = f", global batch {first['global_batch']}" if first.get("global_batch") else ""
        return f"{text}{batch}); batch size, lr and optimizer are the script's; time is {first.get('timing', 'n/a')}"
    if first.get("optimizer") == "adamw":
        optimizer = f"AdamW betas {tuple(first['betas'])}, weight decay {first['weight_decay']:g}"
    else:
        optimizer = f"momentum {first['momentum']:g}"
    schedule = ""
    if first.get("lr_schedule") == "cosine" or first.get("warmup_steps"):
        warmup = f"{first['warmup_steps']} warm-up steps, " if first.get("warmup_steps") else ""
        schedule = f" ({warmup}{'cosine decay to lr/10' if first.get('lr_schedule') == 'cosine' else 'milestones'})"
    return (
        f"{text}, global batch {first['global_batch']} = {first['batch_size']} per worker × workers); "
        f"lr {first['lr']:g}{schedule} unless tuned; {optimizer}"
    )


def _rate(value: float | None) -> str:
    """samples/s, or n/a (a script that does not report ``samples``)."""
    return "n/a" if value is None else f"{value:.0f}"
