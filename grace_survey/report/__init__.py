"""The survey's report (``grace-dgc report``), one module per part: :mod:`.grouping` (the runs
as groups of seeds), :mod:`.significance` (intervals and tests over seeds), :mod:`.headline`
(time to the target, the ranking), :mod:`.notes` ("How to read this"), :mod:`.tables`,
:mod:`.plots`, :mod:`.conditions` (the launch conditions) and :mod:`.writer` (report.md and
the command line). The public names of each are importable from here."""

from grace_survey.report.conditions import BUSY_SHARE, launch_lines
from grace_survey.report.grouping import TIME_PARTS, Group, baseline_of, combos, gather, group_title, peers
from grace_survey.report.headline import (
    RANKING_RULE,
    Reach,
    headline_table,
    is_language_model,
    mean_and_interval,
    metric_name,
    ranked,
    retarget,
    target_text,
)
from grace_survey.report.notes import explanations
from grace_survey.report.plots import (
    PLOTS,
    plot_accuracy_vs_ratio,
    plot_curves,
    plot_time_split,
    pyplot,
    save,
    write_plots,
)
from grace_survey.report.significance import (
    ALPHA,
    MIN_SEEDS_FOR_INTERVAL,
    confidence_interval,
    difference_interval,
    positive_interval,
    scipy_stats,
    significance_table,
    too_few,
    welch_test,
)
from grace_survey.report.tables import (
    general_table,
    kpercent_tables,
    loss_gap,
    methods_table,
    milliseconds,
    target_table,
    tuning_table,
)
from grace_survey.report.writer import DEFINITIONS, add_report_args, main, run_report, write_report

__all__ = [
    "ALPHA",
    "BUSY_SHARE",
    "DEFINITIONS",
    "MIN_SEEDS_FOR_INTERVAL",
    "PLOTS",
    "RANKING_RULE",
    "TIME_PARTS",
    "Group",
    "Reach",
    "add_report_args",
    "baseline_of",
    "combos",
    "confidence_interval",
    "difference_interval",
    "explanations",
    "gather",
    "general_table",
    "group_title",
    "headline_table",
    "is_language_model",
    "kpercent_tables",
    "launch_lines",
    "loss_gap",
    "main",
    "mean_and_interval",
    "methods_table",
    "metric_name",
    "milliseconds",
    "peers",
    "plot_accuracy_vs_ratio",
    "plot_curves",
    "plot_time_split",
    "positive_interval",
    "pyplot",
    "ranked",
    "retarget",
    "run_report",
    "save",
    "scipy_stats",
    "significance_table",
    "target_table",
    "target_text",
    "too_few",
    "tuning_table",
    "welch_test",
    "write_plots",
    "write_report",
]
