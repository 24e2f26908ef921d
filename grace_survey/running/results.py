"""The survey's results files: ``results.jsonl`` (one JSON line per epoch, tuning, summary or
error, appended by rank 0 and fsynced, so a crash loses at most the line being written) and
``summary.csv`` (rewritten from it)."""

import csv
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from grace_survey.running.summary import STEP_TIMES

RESULTS = "results.jsonl"
SUMMARY_CSV = "summary.csv"
CONFIG_JSON = "survey_config.json"
GRID_JSON = "survey_grid.json"  # run_id → cell_hash of the grid the last survey into the folder ran

Record = dict[str, Any]  # one results.jsonl line (parsed JSON)


def append_record(out_dir: str, record: Record) -> None:
    """Append one JSON line to results.jsonl (rank 0 only; flushed at once)."""
    with open(os.path.join(out_dir, RESULTS), "a") as f:
        f.write(json.dumps(_finite(record), sort_keys=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _finite(obj: Any) -> Any:
    """JSON without NaN/Infinity: non-finite floats become null (a diverged run's loss)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_records(out_dir: str) -> list[Record]:
    path = os.path.join(out_dir, RESULTS)
    if not os.path.isfile(path):
        return []
    records: list[Record] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a crash: that run has no summary, so it reruns
    return records


def finished_runs(out_dir: str) -> dict[str, str | None]:
    """run_id → cell_hash of every run with a summary line."""
    return {r["run_id"]: r.get("cell_hash") for r in read_records(out_dir) if r.get("type") == "summary"}


def write_grid(out_dir: str, runs: dict[str, str]) -> None:
    """survey_grid.json: the runs (run_id → cell_hash) of the grid a survey runs into
    ``out_dir``; the report keeps the results of these runs only."""
    with open(os.path.join(out_dir, GRID_JSON), "w") as f:
        json.dump({"runs": runs}, f, indent=1)


def read_grid(out_dir: str) -> dict[str, str] | None:
    """survey_grid.json's runs, or None where there is none (a survey older than the file)."""
    path = os.path.join(out_dir, GRID_JSON)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        runs: dict[str, str] = json.load(f)["runs"]
    return runs


def latest_summaries(records: Iterable[Record]) -> list[Record]:
    """The last summary per run_id, in first-appearance order."""
    latest: dict[str, Record] = {}
    for r in records:
        if r.get("type") == "summary":
            latest.pop(r["run_id"], None)
            latest[r["run_id"]] = r
    return list(latest.values())


def current_runs(records: Sequence[Record], grid: Mapping[str, str] | None) -> tuple[list[Record], list[Record]]:
    """(the records of the runs of ``grid`` — run_id → cell_hash, the grid the last survey into
    the folder ran — and the latest summary of each run left out): a run made with other
    settings (before --epochs changed, say, and not yet run again) or of another grid (a
    method or seed no longer in the config) is no part of this survey's tables. Every record
    is kept where there is no grid (a survey older than survey_grid.json)."""
    if grid is None:
        return list(records), []

    def current(record: Record) -> bool:
        if record.get("type") not in ("summary", "error"):
            return True  # epochs join their summary's attempt; tuning its key
        run = str(record.get("run_id"))
        return run in grid and record.get("cell_hash", grid[run]) == grid[run]

    kept = [r for r in records if current(r)]
    finished = {r["run_id"] for r in kept if r.get("type") == "summary"}
    left_out = [r for r in latest_summaries(records) if r["run_id"] not in finished]
    return kept, left_out


SUMMARY_COLUMNS = [
    "run_id",
    "label",
    "compressor",
    "memory",
    "communicator",
    "params",
    "workers",
    "seed",
    "network",
    "workload",
    "parameters",
    "batch_size",
    "global_batch",
    "lr",
    "lr_tuned",
    "momentum",
    "epochs",
    "steps",
    "final_test_accuracy",
    "final_test_loss",
    "final_train_accuracy",
    "final_train_loss",
    "best_test_accuracy",
    "target_accuracy",
    "epochs_to_target",
    "time_to_target_s",
    "train_time_s",
    "samples_per_s",
    "bytes_per_step",
    "dense_bytes_per_step",
    "compression_ratio",
    "exchanges_per_step",
    "groups_per_step",
    *STEP_TIMES,
    "peak_rss_mb",
    "peak_gpu_mb",
    "device",
    "backend",
    "cell_hash",
    "finished",
]


def write_summary_csv(out_dir: str) -> str:
    """summary.csv: one row per finished run (its latest summary), rewritten from results.jsonl."""

    rows = latest_summaries(read_records(out_dir))
    path = os.path.join(out_dir, SUMMARY_CSV)
    with open(path + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, SUMMARY_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            flat = dict(row)
            flat["params"] = json.dumps(row.get("params", {}), sort_keys=True)
            flat["lr_tuned"] = bool(row.get("lr_tuning"))
            writer.writerow(flat)
    os.replace(path + ".tmp", path)
    return path
