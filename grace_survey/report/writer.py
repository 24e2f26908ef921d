"""``grace-dgc report DIR``: report.md with the seeds' tables and PNG plots from a survey's
results.jsonl. This module puts the report together (:func:`write_report`) and holds its
command line; the sections come from the other modules of :mod:`grace_survey.report`.

Sections, in order:

1. **Time to the target** (the headline): per workers × network, methods ranked by the mean
   over seeds of the training time to the workload's target metric (test accuracy;
   next-token accuracy for language models), with a 95% CI over seeds, epochs to target
   likewise, the speed-up against the baseline (the dense ``none`` compressor) and Welch's
   p on the times. Methods every seed of which reached the target come first, by mean time;
   then those some seeds of which did ("k of n seeds reached it"), by that share; then
   those that never did ("never reached (best … < target …)"), by best accuracy
   (:data:`~grace_survey.report.headline.RANKING_RULE`, printed under the table).
2. **Throughput, bytes and final accuracy** (the general table): test accuracy mean ± std
   over seeds, perplexity for language models, bytes per step, measured compression ratio,
   time split per step, samples/s, peak memory.
3. **How to read this**: notes computed from the records, each only where its case occurs
   (a sparsifier with a smaller ratio sending more bytes, with what the method itself says
   about its bytes, as DGC's dense small / 1-D tensors; fewer bytes but a slower step on an
   unshaped loopback; fastest to the target vs most accurate at the end; "no significant
   difference" is not "equal").
4. **Do the seeds support the differences?**: final accuracy CIs and Welch tests against
   the baseline.
5. The methods' settings, the time-to-accuracy table (epochs and time to the target,
   final test/train accuracy, compression ratio, gradient update size), the k-percent masking
   table (``Send k% grads | Accuracy | Loss``) for runs tagged ``kpercent`` (the two
   experiments the survey grew from: presets ``dgc-resnet20-time-to-accuracy`` and
   ``kpercent-masking``), the lr-tuning
   outcomes, plots (matplotlib, Agg: test accuracy and loss per epoch, accuracy vs measured
   compression ratio, time split per step as stacked bars), failed runs, definitions.

The names the single module held before the report was split (issue 41) are importable from
the package, :mod:`grace_survey.report`.
"""

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from grace_dgc.errors import GraceConfigError
from grace_survey.report.conditions import launch_lines
from grace_survey.report.faults import FAULTS_TEXT, fault_rows, fault_table
from grace_survey.report.grouping import Group, gather
from grace_survey.report.headline import (
    RANKING_RULE,
    headline_table,
    is_language_model,
    metric_name,
    retarget,
    target_text,
)
from grace_survey.report.notes import explanations
from grace_survey.report.plots import CAPTIONS, PLOTS, write_plots
from grace_survey.report.significance import (
    scipy_stats,
    significance_table,
)
from grace_survey.report.tables import (
    general_table,
    kpercent_tables,
    methods_table,
    target_table,
    tuning_table,
)
from grace_survey.running.results import (
    CONFIG_JSON,
    GRID_JSON,
    Record,
    current_runs,
    read_grid,
    read_records,
)

__all__ = ["DEFINITIONS", "add_report_args", "current_runs", "main", "run_report", "write_report"]


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

LANGUAGE_MODEL_DEFINITIONS = (
    "\n- **Loss gap to baseline** (language models): mean final test loss minus the baseline's (the `none` "
    "compressor of the same workers and network), in nats, with the 95% CI of the difference: paired over "
    "seeds where both ran the same seeds (same initial weights and batches), else Welch's."
    "\n- **Perplexity** (language models): exp(final test loss) per seed, mean ± std over seeds."
)

SIGNIFICANCE_TEXT = (
    "Test accuracy: mean and 95% confidence interval over seeds (Student t, n−1 degrees of freedom, "
    "clipped to [0, 1]; from 3 seeds on); "
    "Welch's t-test against the baseline of the same workers and network (the `none` compressor, else "
    "the first method). A difference is called only at p < 0.05; one seed supports no claim."
)


def write_report(out_dir: str, report_dir: str | None = None, target: float | None = None) -> str:
    """Write report.md and the PNGs; returns the report's path. The headline's target is
    ``target`` when given, else the survey's current one (its config.json: a target changed
    since the runs finished applies without running them again), else the runs' own."""
    records, left_out = current_runs(read_records(out_dir), read_grid(out_dir))
    groups, tuning, failures = gather(records)
    if not groups and left_out:
        raise GraceConfigError(
            f"no run in {out_dir!r} was made with the settings its last survey asked for ({len(left_out)} "
            f"from an earlier configuration, e.g. {left_out[0]['run_id']!r}); run that survey again to finish it"
        )
    if not groups:
        raise GraceConfigError(
            f"no finished runs in {out_dir!r} (results.jsonl has no summary lines); "
            f"run `grace-dgc survey ... --out {out_dir}` first"
        )
    scipy_stats()  # an optional dependency: missing, nothing is written
    report_dir = report_dir or out_dir
    os.makedirs(report_dir, exist_ok=True)
    config = _survey_config(out_dir)
    target = target if target is not None else config.get("target_accuracy")
    if target is not None:
        retarget(groups, float(target))
    write_plots(groups, report_dir)
    parts = (
        _preamble(config, groups)
        + _left_out_section(left_out)
        + _headline_section(groups)
        + _general_section(groups)
        + _significance_section(groups)
        + _method_sections(groups, tuning)
        + _faults_section(groups)
        + _plots_section()
        + _failures_section(failures)
        + _definitions_section(groups)
    )
    path = os.path.join(report_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def _left_out_section(left_out: Sequence[Record]) -> list[str]:
    """The runs in results.jsonl that the tables leave out (:func:`current_runs`), named."""
    if not left_out:
        return []
    names = ", ".join(f"`{r['run_id']}`" for r in left_out[:12])
    more = f" and {len(left_out) - 12} more" if len(left_out) > 12 else ""
    return [
        "## Runs left out",
        "",
        f"{len(left_out)} run(s) in results.jsonl were made with settings other than those the last survey into "
        f"this folder asked for ({GRID_JSON}): an earlier configuration's, or a method, worker count or seed it no "
        f"longer names. They are not in the tables or plots: {names}{more}. A run of the survey's grid among them "
        "is run again by the next `grace-dgc survey` into this folder.",
        "",
    ]


def _survey_config(out_dir: str) -> dict[str, Any]:
    """The survey's config.json as it stands now, or {} where there is none."""
    if not os.path.isfile(os.path.join(out_dir, CONFIG_JSON)):
        return {}
    with open(os.path.join(out_dir, CONFIG_JSON)) as f:
        config: dict[str, Any] = json.load(f)
    return config


def _preamble(config: Mapping[str, Any], groups: Sequence[Group]) -> list[str]:
    """The title, the survey's description and what the runs ran: workload, workers, seeds, set-up."""
    first = groups[0].runs[0]
    name = config.get("name") or first.get("survey") or "survey"
    parts = [f"# Survey report: {name}", ""]
    if config.get("description"):
        parts += [config["description"], ""]
    seeds = sorted({r["seed"] for g in groups for r in g.runs})
    return parts + [
        f"- Workload: **{first['workload']}** — {first.get('workload_description', '')}",
        f"- Workers: {', '.join(str(w) for w in sorted({g.workers for g in groups}))}; seeds: "
        f"{', '.join(map(str, seeds))}; {_setup_text(first)}",
        f"- Device: {first.get('device')}, backend {first.get('backend')}, torch {first.get('torch')}, "
        f"host {first.get('host')}",
        *launch_lines([r for g in groups for r in g.runs]),
        "",
    ]


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


def _headline_section(groups: Sequence[Group]) -> list[str]:
    """Time to the target, or why there is none (a workload or script without a target)."""
    first = groups[0].runs[0]
    if first.get("target_accuracy") is None:
        return [
            "## Time to the target",
            "",
            f"No target {metric_name(first)} was set (`target_accuracy` in the config or the workload), so no time "
            "to target was measured; the methods are compared by final accuracy and throughput below.",
            "",
        ]
    return [
        f"## Time to {metric_name(first)} {target_text(first['target_accuracy'])} (the headline)",
        "",
        headline_table(groups),
        "",
        RANKING_RULE.format(metric=metric_name(first)),
        "",
    ]


def _general_section(groups: Sequence[Group]) -> list[str]:
    """Throughput, bytes and final accuracy, then the notes on reading it (where any case occurs)."""
    parts = ["## Throughput, bytes and final accuracy", "", general_table(groups), ""]
    notes = explanations(groups)
    if notes:
        parts += ["## How to read this", ""] + [f"- {note}" for note in notes] + [""]
    return parts


def _significance_section(groups: Sequence[Group]) -> list[str]:
    return ["## Do the seeds support the differences?", "", SIGNIFICANCE_TEXT, "", significance_table(groups), ""]


def _method_sections(groups: Sequence[Group], tuning: Sequence[Record]) -> list[str]:
    """The methods' settings, the two founding experiments' tables, the lr tuning (each where it applies)."""
    parts = ["## Methods", "", methods_table(groups), ""]
    target = groups[0].runs[0].get("target_accuracy")
    if target is not None:
        parts += [
            f"## Epochs and time to {target * 100:g}%, per method",
            "",
            "In the columns of the time-to-accuracy experiment the survey grew from (dense against DGC on "
            "CIFAR-10 ResNet-20: preset `dgc-resnet20-time-to-accuracy`); means over seeds.",
            "",
            target_table(groups),
            "",
        ]
    kp = kpercent_tables(groups)
    if kp:
        parts += [
            "## Send k% of the gradient",
            "",
            "Accuracy and loss when each step sends only the largest k % of the gradient by magnitude, without "
            "error feedback: the masking experiment the survey grew from (preset `kpercent-masking`); mean ± std "
            "over seeds.",
            "",
        ]
        for table in kp:
            parts += [table, ""]
    if tuning:
        parts += ["## Learning-rate tuning (best held-out accuracy)", "", tuning_table(tuning), ""]
    return parts


def _faults_section(groups: Sequence[Group]) -> list[str]:
    """Each run that lost a replica group beside the same method under torchft without a fault
    (launched alike): the metric and the training time the fault cost."""
    rows = fault_rows(groups)
    if not rows:
        return []
    return ["## Faults: a replica group lost and taken back (torchft)", "", FAULTS_TEXT, "", fault_table(rows), ""]


def _plots_section() -> list[str]:
    parts = ["## Plots", ""]
    for name, title, _ in PLOTS:
        parts += [f"![{title}]({name})", ""] + ([f"*{CAPTIONS[name]}*", ""] if name in CAPTIONS else [])
    return parts


def _failures_section(failures: Sequence[Record]) -> list[str]:
    """Each failed run without a later success, with the last line of its error."""
    if not failures:
        return []
    return [
        "## Failed runs",
        "",
        *(
            f"- `{f['run_id']}`: {f['message'].strip().splitlines()[-1] if f['message'].strip() else '?'}"
            for f in failures
        ),
        "",
    ]


def _definitions_section(groups: Sequence[Group]) -> list[str]:
    definitions = DEFINITIONS
    if any(is_language_model(r) for g in groups for r in g.runs):
        definitions += LANGUAGE_MODEL_DEFINITIONS
    return ["## Definitions", "", definitions, ""]


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
