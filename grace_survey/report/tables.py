"""The report's tables apart from the headline and the seed statistics: throughput, bytes and
final accuracy (:func:`general_table`, with the language models' :func:`loss_gap` and
perplexity), the methods' settings, epochs and time to the target in the columns of the
ResNet-20 time-to-accuracy experiment (:func:`target_table`), accuracy and loss per share of the
gradient sent, as the k-percent masking experiment gives them (:func:`kpercent_tables`), and
the lr-tuning outcomes (:func:`tuning_table`)."""

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grace_survey.report.grouping import Group, baseline_of, group_title
from grace_survey.report.headline import is_language_model
from grace_survey.report.significance import (
    ALPHA,
    MIN_SEEDS_FOR_INTERVAL,
    difference_interval,
    scipy_stats,
    too_few,
)
from grace_survey.units import human_bytes, human_seconds, shown_path

STEP_TIMES = ("compute_s", "compress_s", "communicate_s", "decompress_s", "step_s")  # the table's ms columns


def milliseconds(value: float | None) -> str:
    """Seconds as milliseconds with 2 decimals, or n/a."""
    return "n/a" if value is None else f"{value * 1000:.2f}"


def _rate(value: float | None) -> str:
    """samples/s, or n/a (a script that does not report ``samples``)."""
    return "n/a" if value is None else f"{value:.0f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


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
        times = " | ".join(milliseconds(g.mean(key)) for key in STEP_TIMES)
        lines.append(
            f"| {g.label} | {g.workers} | {g.network} | {len(g.runs)} | {g.mean_std('final_test_accuracy')} | "
            f"{g.mean_std('final_test_loss')} | {perplexity}{human_bytes(g.mean('bytes_per_step'))} | "
            f"{g.mean('compression_ratio'):.4g} | {times} | {_rate(g.mean('samples_per_s'))} | {memory} |"
        )
    return "\n".join(lines)


def loss_gap(group: Group, groups: Sequence[Group]) -> str:
    """Mean final test loss minus the baseline's (same workers and network), in nats, with
    the 95% CI of the difference where both ran enough seeds: how far above dense a language
    model ends, the figure an accuracy hides. Runs of one seed start from the same weights and
    see the same batches, so where both ran the same seeds the interval is the paired one
    (Student t on the per-seed differences), else Welch's."""
    base = baseline_of(group, groups)
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
        half = float(scipy_stats().t.ppf(1 - ALPHA / 2, len(differences) - 1)) * float(
            differences.std(ddof=1) / np.sqrt(len(differences))
        )
        return f"{gap:+.3f} [{gap - half:+.3f}, {gap + half:+.3f}] paired"
    interval = difference_interval(list(mine.values()), list(theirs.values()))
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


def methods_table(groups: Sequence[Group]) -> str:
    """Each method label's compressor, memory, communicator, parameters and lr."""
    lines = [
        "| Method | Compressor | Memory | Communicator | Parameters | lr |",
        "|---|---|---|---|---|---|",
    ]
    for g in dict((g.label, g) for g in groups).values():
        r = g.runs[0]
        params = ", ".join(f"{k}={v}" for k, v in r.get("params", {}).items()) or "—"
        lrs = sorted({x["lr"] for x in g.runs if x.get("lr") is not None})
        lr = ", ".join(f"{x:g}" for x in lrs if x is not None) or "the script's"
        lr += " (tuned)" if r.get("lr_tuning") else ""
        parts = " | ".join(str(shown_path(r[part])) for part in ("compressor", "memory", "communicator"))  # no home dir
        lines.append(f"| {g.label} | {parts} | {params} | {lr} |")
    return "\n".join(lines)


def target_table(groups: Sequence[Group]) -> str:
    """Epochs and time to the target accuracy and the final figures, in the columns of the
    ResNet-20 time-to-accuracy experiment the survey grew from (preset
    ``dgc-resnet20-time-to-accuracy``). Mean epochs as the headline shows them (2 decimals)."""
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
            ep = f"{statistics.mean(reached):.2f} epochs"
            tt = human_seconds(g.mean("time_to_target_s"))
        elif reached:
            ep = f"{statistics.mean(reached):.2f} epochs ({len(reached)}/{len(g.runs)} seeds)"
            tt = human_seconds(g.mean("time_to_target_s"))
        else:
            ep, tt = "not reached", "—"
        lines.append(
            f"| {group_title(g, groups)} | {ep} | {tt} | "
            f"{_pct(g.mean('final_test_accuracy'))} | {_pct(g.mean('final_train_accuracy'))} | "
            f"{g.mean('compression_ratio'):.4g} | {human_bytes(g.mean('bytes_per_step'))} |"
        )
    return "\n".join(lines)


def kpercent_tables(groups: Sequence[Group]) -> list[str]:
    """The k-percent masking tables (``Send k% grads | Accuracy | Loss``, preset
    ``kpercent-masking``), one per worker count, for runs tagged with ``kpercent``."""
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
