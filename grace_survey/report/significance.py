"""Statistics over a survey's seeds: Student-t confidence intervals (of a mean, of a positive
quantity's geometric mean, of a difference of means), Welch's t-test against the baseline,
and the report's "Do the seeds support the differences?" table built from them. scipy is an
optional dependency: :func:`scipy_stats` names the extra that brings it."""

import warnings
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from grace_survey.extras import require
from grace_survey.report.grouping import Group, baseline_of

ALPHA = 0.05
MIN_SEEDS_FOR_INTERVAL = 3  # below it, an interval from n − 1 ≤ 1 degrees of freedom says nothing useful


def scipy_stats() -> ModuleType:
    """``scipy.stats``, or an error naming the optional dependency the report needs."""
    return require("scipy.stats", "the report's confidence intervals and t-tests")


def confidence_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None]:
    """(mean, half-width) of the Student-t interval; half-width None below 2 values."""
    array = np.asarray(values, dtype=np.float64)
    mean = float(array.mean())
    if len(array) < 2:
        return mean, None
    sem = float(array.std(ddof=1)) / np.sqrt(len(array))
    return mean, float(scipy_stats().t.ppf(0.5 + level / 2, len(array) - 1)) * sem


def positive_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The Student-t interval of a positive quantity's geometric mean, computed on the log
    scale and mapped back: it stays above zero, as a time or an epoch count does (a plain
    t interval of 2 seeds' times reached −8.4 s). None below MIN_SEEDS_FOR_INTERVAL values."""
    array = np.asarray(values, dtype=np.float64)
    if len(array) < MIN_SEEDS_FOR_INTERVAL or bool((array <= 0).any()):
        return None
    logs = np.log(array)
    half = float(scipy_stats().t.ppf(0.5 + level / 2, len(array) - 1)) * float(logs.std(ddof=1)) / np.sqrt(len(array))
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
        result = scipy_stats().ttest_ind(a, b, equal_var=False)
    return float(result.statistic), float(result.pvalue)


def difference_interval(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float] | None:
    """95% CI of mean(values) − mean(baseline), Welch–Satterthwaite degrees of freedom."""
    a, b = np.asarray(values, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return None
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(scipy_stats().t.ppf(1 - ALPHA / 2, df)) * float(np.sqrt(va + vb))
    delta = float(a.mean() - b.mean())
    return delta - half, delta + half


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
        base = baseline_of(g, groups)
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
