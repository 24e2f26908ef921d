"""``grace-dgc report DIR``: report.md with the seeds' tables and PNG plots from a survey's
results.jsonl.

Tables: the general one (every method: test accuracy mean ± std over seeds, bytes per step,
measured compression ratio, time split per step); the seed001 format (epochs and time to
the target accuracy, final test/train accuracy, compression ratio, gradient update size);
the seed000 format (``Send k% grads | Accuracy | Loss``) for runs tagged ``kpercent``; the
lr-tuning outcomes. Plots (matplotlib, Agg): test accuracy and loss per epoch per method,
accuracy vs measured compression ratio, time split per step as stacked bars.
"""

import argparse
import json
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import GraceConfigError
from .extras import require
from .results import CONFIG_JSON, Record, latest_summaries, read_records
from .units import human_bytes, human_seconds

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


def welch_test(values: Sequence[float], baseline: Sequence[float]) -> tuple[float, float] | None:
    """(t, p) of Welch's two-sided t-test (unequal variances); None below 2 values a side
    or when both sides are constant."""
    a, b = np.asarray(values, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if len(a) < 2 or len(b) < 2 or (a.std() == 0 and b.std() == 0):
        return None
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
        interval = "n/a (1 seed)" if half is None else f"[{mean - half:.4f}, {mean + half:.4f}]"
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
    lines = [
        "| Method | Workers | Network | Seeds | Test acc (mean ± std) | Test loss | Bytes/step/worker | "
        "Compression ratio | Compute ms | Compress ms | Communicate ms | Decompress ms | Step ms | "
        "Samples/s | Peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        rss = g.mean("peak_rss_mb")
        gpu = g.mean("peak_gpu_mb")
        memory = f"{rss:.0f} MB" + (f" (GPU {gpu:.0f} MB)" if gpu else "")
        lines.append(
            f"| {g.label} | {g.workers} | {g.network} | {len(g.runs)} | {g.mean_std('final_test_accuracy')} | "
            f"{g.mean_std('final_test_loss')} | {human_bytes(g.mean('bytes_per_step'))} | "
            f"{g.mean('compression_ratio'):.4g} | {_ms(g.mean('compute_s'))} | {_ms(g.mean('compress_s'))} | "
            f"{_ms(g.mean('communicate_s'))} | {_ms(g.mean('decompress_s'))} | {_ms(g.mean('step_s'))} | "
            f"{g.mean('samples_per_s'):.0f} | {memory} |"
        )
    return "\n".join(lines)


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
- **Samples/s**: global samples per second of training wall time. **Peak RSS**: the largest
  `ru_maxrss` over the ranks (GPU: `torch.cuda.max_memory_allocated`)."""


def write_report(out_dir: str, report_dir: str | None = None) -> str:
    """Write report.md and the PNGs; returns the report's path."""
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
        f"{', '.join(map(str, seeds))}; epochs: {first['epochs']} ({first['steps_per_epoch']} steps each, "
        f"global batch {first['global_batch']} = {first['batch_size']} per worker × workers); "
        f"lr {first['lr']:g} unless tuned; momentum {first['momentum']:g}",
        f"- Device: {first.get('device')}, backend {first.get('backend')}, torch {first.get('torch')}, "
        f"host {first.get('host')}",
        "",
        "## Methods",
        "",
        "| Method | Compressor | Memory | Communicator | Parameters | lr |",
        "|---|---|---|---|---|---|",
    ]
    for g in dict((g.label, g) for g in groups).values():
        r = g.runs[0]
        params = ", ".join(f"{k}={v}" for k, v in r.get("params", {}).items()) or "—"
        lrs = sorted({x["lr"] for x in g.runs})
        lr = ", ".join(f"{x:g}" for x in lrs) + (" (tuned)" if r.get("lr_tuning") else "")
        parts.append(f"| {g.label} | {r['compressor']} | {r['memory']} | {r['communicator']} | {params} | {lr} |")
    parts += [
        "",
        "## Results",
        "",
        general_table(groups),
        "",
        "## Do the seeds support the differences?",
        "",
        "Test accuracy: mean and 95% confidence interval over seeds (Student t, n−1 degrees of freedom); "
        "Welch's t-test against the baseline of the same workers and network (the `none` compressor, else "
        "the first method). A difference is called only at p < 0.05; one seed supports no claim.",
        "",
        significance_table(groups),
        "",
        f"## Time to accuracy (the seed001 format; target {first['target_accuracy'] * 100:g}%)",
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
    parts += ["## Definitions", "", DEFINITIONS, ""]
    path = os.path.join(report_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def add_report_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("dir", help="a survey output directory (with results.jsonl)")
    parser.add_argument("--out", help="where to write report.md and the PNGs (default: DIR)")
    return parser


def run_report(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        raise GraceConfigError(f"{args.dir!r} is not a directory")
    path = write_report(args.dir, args.out)
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_report(add_report_args(argparse.ArgumentParser(prog="grace-dgc report")).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
