"""The report's PNG plots (matplotlib on the Agg backend, an optional dependency): test
accuracy and loss per epoch, accuracy against the measured compression ratio (with the same
95 % intervals as the statistics table), and the time split per step as stacked bars;
:func:`pyplot` and :func:`save` serve the projection's plot too."""

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from grace_survey.extras import require
from grace_survey.report.grouping import TIME_PARTS, Group, group_title
from grace_survey.report.significance import MIN_SEEDS_FOR_INTERVAL, confidence_interval

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend."""
    matplotlib = require("matplotlib", "the survey's plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: ModuleType, fig: "Figure", path: str, laid_out: bool = False) -> str:
    """Lay ``fig`` out (unless ``laid_out``), write it to ``path`` as a PNG and close it; returns ``path``."""
    if not laid_out:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(groups: Sequence[Group], path: str) -> str:
    plt = pyplot()
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    for g in groups:
        acc, loss = g.curve("test_accuracy"), g.curve("test_loss")
        epochs = list(range(1, len(acc) + 1))
        title = group_title(g, groups)
        ax_acc.plot(epochs, acc, marker="o", ms=3, label=title)
        ax_loss.plot(epochs, loss, marker="o", ms=3, label=title)
    from matplotlib.ticker import MaxNLocator

    last = max((len(g.curve("test_accuracy")) for g in groups), default=0)
    for ax in (ax_acc, ax_loss):  # epochs are whole: 1, 2, 3
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        if 0 < last <= 15:
            ax.set_xticks(range(1, last + 1))
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy per epoch")
    ax_loss.set(xlabel="epoch", ylabel="test loss", title="Test loss per epoch")
    if any(v > 0 for g in groups for v in g.curve("test_loss") if v == v):
        ax_loss.set_yscale("log")
        plain_log_labels(ax_loss.yaxis)
    ax_acc.legend(fontsize=7, ncol=1 + len(groups) // 12)
    return save(plt, fig, path)


def plain_log_labels(axis: Any) -> None:
    """A log axis labelled in plain numbers (0.02, 1.2, 3), not matplotlib's 1.2×10⁰: its
    decades, and its minor ticks too where it spans less than one (a loss from 1.6 to 2.1)."""
    import math

    from matplotlib.ticker import FuncFormatter

    def minor(value: float, _position: int) -> str:
        low, high = sorted(axis.get_view_interval())
        return f"{value:g}" if low > 0 and math.log10(high / low) <= 1 else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


#: what the error bars of accuracy_vs_ratio.png show, as its caption says
ACCURACY_BARS = (
    f"Error bars: the 95% confidence interval of the mean over seeds (Student t, as in the statistics "
    f"table; from {MIN_SEEDS_FOR_INTERVAL} seeds on)"
)


def plot_accuracy_vs_ratio(groups: Sequence[Group], path: str) -> str:
    """Mean final test accuracy against the measured compression ratio, one point per group,
    with the 95 % Student-t interval over seeds that the statistics table gives (clipped to
    [0, 1]; no bar under 3 seeds), said in the caption."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for g in groups:
        mean, half = confidence_interval(g.values("final_test_accuracy"))
        ratio = g.mean("compression_ratio")
        if half is None or len(g.values("final_test_accuracy")) < MIN_SEEDS_FOR_INTERVAL:
            bar: Any = None
        else:
            bar = [[mean - max(0.0, mean - half)], [min(1.0, mean + half) - mean]]
        ax.errorbar([ratio], [mean], yerr=bar, fmt="o", capsize=3, label=group_title(g, groups))
        ax.annotate(g.label, (ratio, mean), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    plain_log_labels(ax.xaxis)
    ax.set(
        xlabel="measured compression ratio (bytes sent / dense fp32 bytes)",
        ylabel="final test accuracy (mean over seeds)",
        title="Accuracy vs measured compression ratio",
    )
    fig.text(0.5, 0.01, ACCURACY_BARS, ha="center", va="bottom", fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(plt, fig, path, laid_out=True)


def plot_time_split(groups: Sequence[Group], path: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(groups) + 2), 4.5))
    names = [group_title(g, groups) for g in groups]
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
    return save(plt, fig, path)


#: the report's plots: the file each writes, its title in report.md, what draws it
PLOTS: tuple[tuple[str, str, Callable[[Sequence[Group], str], str]], ...] = (
    ("accuracy_loss.png", "Test accuracy and loss per epoch", plot_curves),
    ("accuracy_vs_ratio.png", "Accuracy vs measured compression ratio", plot_accuracy_vs_ratio),
    ("time_split.png", "Time split per step", plot_time_split),
)


#: a caption under a plot in report.md, where its picture needs one
CAPTIONS = {"accuracy_vs_ratio.png": ACCURACY_BARS + "."}


def write_plots(groups: Sequence[Group], report_dir: str) -> list[str]:
    """Every plot of :data:`PLOTS` into ``report_dir``; returns their paths."""
    return [draw(groups, os.path.join(report_dir, name)) for name, _, draw in PLOTS]
