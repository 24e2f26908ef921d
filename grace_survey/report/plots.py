"""The report's PNG plots (matplotlib on the Agg backend, an optional dependency): test
accuracy and loss per epoch, accuracy against the measured compression ratio, and the time
split per step as stacked bars; :func:`pyplot` and :func:`save` serve the projection's plot
too."""

import os
import statistics
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from grace_survey.extras import require
from grace_survey.report.grouping import TIME_PARTS, Group, group_title

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend."""
    matplotlib = require("matplotlib", "the survey's plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: ModuleType, fig: "Figure", path: str) -> str:
    """Lay ``fig`` out, write it to ``path`` as a PNG and close it; returns ``path``."""
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
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy per epoch")
    ax_loss.set(xlabel="epoch", ylabel="test loss", title="Test loss per epoch")
    if any(v > 0 for g in groups for v in g.curve("test_loss") if v == v):
        ax_loss.set_yscale("log")
    ax_acc.legend(fontsize=7, ncol=1 + len(groups) // 12)
    return save(plt, fig, path)


def plot_accuracy_vs_ratio(groups: Sequence[Group], path: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for g in groups:
        accs = g.values("final_test_accuracy")
        ratio = g.mean("compression_ratio")
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        ax.errorbar([ratio], [statistics.mean(accs)], yerr=[std], fmt="o", capsize=3, label=group_title(g, groups))
        ax.annotate(g.label, (ratio, statistics.mean(accs)), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set(
        xlabel="measured compression ratio (bytes sent / dense fp32 bytes)",
        ylabel="final test accuracy",
        title="Accuracy vs measured compression ratio",
    )
    ax.grid(True, which="both", alpha=0.3)
    return save(plt, fig, path)


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


def write_plots(groups: Sequence[Group], report_dir: str) -> list[str]:
    """Every plot of :data:`PLOTS` into ``report_dir``; returns their paths."""
    return [draw(groups, os.path.join(report_dir, name)) for name, _, draw in PLOTS]
