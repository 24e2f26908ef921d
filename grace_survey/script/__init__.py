"""Script mode: the API a user's training script imports (:mod:`~grace_survey.script.api`), the
supervisor that runs it once per cell (:mod:`~grace_survey.script.supervisor`) and what the two
agree on (:mod:`~grace_survey.script.protocol`); every public name of each is importable here."""

from grace_survey.script.api import MEASURED, RENAMED, cell, cell_grace, cell_seed, report_metrics
from grace_survey.script.protocol import (
    CELL_ENV,
    DIR_ENV,
    FAILED,
    FINISHED,
    REPORT_WAIT_S,
    SCRIPT_RUNS,
    STARTED,
    report_file,
)
from grace_survey.script.supervisor import STANDARD, STRAGGLE_S, check_launcher, compose, run_script_cell

__all__ = [
    "CELL_ENV",
    "DIR_ENV",
    "FAILED",
    "FINISHED",
    "MEASURED",
    "RENAMED",
    "REPORT_WAIT_S",
    "SCRIPT_RUNS",
    "STANDARD",
    "STARTED",
    "STRAGGLE_S",
    "cell",
    "cell_grace",
    "cell_seed",
    "check_launcher",
    "compose",
    "report_file",
    "report_metrics",
    "run_script_cell",
]
