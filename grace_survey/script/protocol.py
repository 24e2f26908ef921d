"""What the two sides of a script-mode cell agree on: the environment the survey hands each rank
of the user's script, and the files the ranks leave in their cell's folder (a marker when the
script asks for its method, one at a clean exit, an uncaught exception, the reports) for the
survey to read."""

import os

CELL_ENV = "GRACE_DGC_CELL"  # the cell, as JSON
DIR_ENV = "GRACE_DGC_CELL_DIR"  # where the ranks write their reports
SCRIPT_RUNS = "script-runs"  # OUT/script-runs/<run>-<attempt>/: one cell's folder
STARTED = "started"  # the marker cell_grace writes: the script asked for its method
FAILED = "failed"  # failed<rank>: the time and traceback of a rank's uncaught exception
FINISHED = "finished"  # finished<rank>: the rank's script ended without an uncaught exception
REPORT_WAIT_S = 300.0  # the longest a rank waits at its first report for the others (shorter in a short cell)


def report_file(directory: str, rank: int) -> str:
    """The JSON lines file rank ``rank`` appends its reports to, one per ``report_metrics`` call."""
    return os.path.join(directory, f"rank{rank}.jsonl")
