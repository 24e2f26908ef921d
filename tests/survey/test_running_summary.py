"""The summary line is built in one place (grace_survey.running.summary) for built-in workloads and
script mode: its keys in their order for both (the order results.jsonl has always had), the
figures it derives from the epoch records, and the time metrics' names that every record and
summary.csv use. No ranks are started: one single-process run (local engine) and reports made
up here."""

import datetime
import json

import pytest

from grace_survey import script
from grace_survey.config import settings as cfg
from grace_survey.running import runner
from grace_survey.running.context import Context
from grace_survey.running.metrics import RankTotals, epoch_record
from grace_survey.running.results import SUMMARY_COLUMNS
from grace_survey.running.summary import (
    MEASURED_TIMES,
    STEP_TIMES,
    SummaryParts,
    mean_step_times,
    summary_record,
)

HEAD = ["run_id", "attempt", "label", "workers", "seed", "network", "type"]
CELL = ["cell_hash", "survey", "compressor", "memory", "communicator", "params", "tags", "schedule"]
CELL += ["bandwidth_bps", "latency_ms"]
OUTCOME = ["epochs", "steps_per_epoch", "steps", "final_test_accuracy", "final_test_loss", "final_train_accuracy"]
OUTCOME += ["final_train_loss", "best_test_accuracy", "target_accuracy", "epochs_to_target", "time_to_target_s"]
OUTCOME += ["train_time_s", "samples_per_s", "bytes_per_step", "dense_bytes_per_step", "compression_ratio"]
OUTCOME += ["exchanges_per_step", "groups_per_step", "peak_rss_mb", "peak_gpu_mb", "device", "backend", "engine"]
HOST = ["torch", "grace_dgc", "host", "python"]
TIMES = ["compute_s", "compress_s", "communicate_s", "decompress_s", "wait_s", "step_s"]
BUILT_IN = [
    *HEAD,
    *CELL,
    *["workload", "workload_description", "metric", "loss", "parameters", "batch_size", "global_batch", "lr"],
    *["lr_tuning", "optimizer", "momentum", "betas", "weight_decay", "lr_schedule", "warmup_steps"],
    *OUTCOME,
    *HOST,
    *["launch", "started", "finished", "method_stats", "shaping"],
    *TIMES,
]
SCRIPT = [
    *HEAD,
    *CELL,
    *["workload", "workload_description", "metric", "loss", "script", "script_args", "script_sha", "parameters"],
    *["batch_size", "global_batch", "lr", "lr_tuning", "momentum", "weight_decay"],
    *OUTCOME,
    "timing",
    *HOST,
    *["started", "finished", "method_stats", "metrics", "shaping"],
    *TIMES,
]
TINY = {
    "name": "tiny",
    "workload": "digits-mlp",
    "workers": 1,
    "epochs": 2,
    "target_accuracy": 0.2,
    "workload_options": {"train_samples": 256, "test_samples": 100},
    "methods": [{"label": "dense", "compressor": "none"}],
}


def test_the_metric_names_are_the_records_and_the_csv_columns():
    assert STEP_TIMES == ("compute_s", "compress_s", "communicate_s", "decompress_s", "wait_s", "step_s")
    assert MEASURED_TIMES == STEP_TIMES[:-1] and len(RankTotals.TIMERS) == len(MEASURED_TIMES)
    start = SUMMARY_COLUMNS.index("compute_s")
    assert tuple(SUMMARY_COLUMNS[start : start + len(STEP_TIMES)]) == STEP_TIMES
    totals = RankTotals(
        count=4, timed_steps=2, train_time=1.0, compute=0.5, compress=0.1, communicate=0.2, decompress=0.3, wait=0.25
    )
    record = epoch_record([totals], 1, 0.1, 2, 4, 0.0, 0.5, 0.5, {})
    assert [key for key in record if key in STEP_TIMES] == list(STEP_TIMES)
    assert [record[key] for key in MEASURED_TIMES] == [0.25, 0.05, 0.1, 0.15, 0.125]
    assert record["step_s"] == 0.25 + 0.125


def test_a_built_in_run_s_summary_line_keeps_its_keys_in_order(tmp_path):
    conf = cfg.SurveyConfig(TINY)
    cell = conf.cells(cache_dir=str(tmp_path))[0]
    summary = runner.execute_cell(Context.detect("cpu"), cell, str(tmp_path), progress=False)
    assert list(summary) == BUILT_IN
    (line,) = [r for r in runner.read_records(str(tmp_path)) if r["type"] == "summary"]
    assert list(line) == BUILT_IN
    epochs = [r for r in runner.read_records(str(tmp_path)) if r["type"] == "epoch"]
    assert summary["steps"] == sum(e["steps"] for e in epochs) and summary["epochs"] == 2
    assert summary["best_test_accuracy"] == max(e["test_accuracy"] for e in epochs)
    reached = next((e for e in epochs if e["test_accuracy"] >= 0.2), None)
    assert summary["epochs_to_target"] == (reached["epoch"] if reached else None)
    assert summary["time_to_target_s"] == (reached["elapsed_s"] if reached else None)
    assert summary["launch"]["launcher"] == "survey" and summary["engine"] == "local"


def _report(epoch, rank, samples=True, timed=False, lr=None):
    measured = dict.fromkeys(script.MEASURED, 0.0)
    measured.update(steps=5.0, bytes_sent=40.0 * (rank + 1), dense_bytes=400.0, tensors=10.0, groups=5.0)
    measured.update(compress_seconds=0.1, memory_seconds=0.05, communicate_seconds=0.2, wait_seconds=0.5)
    metrics = {"test_accuracy": 0.3 * epoch, "test_loss": 1.0 / epoch, "train_loss": 2.0, "custom": 7.0}
    metrics.update({"samples": 20.0} if samples else {})
    metrics.update({} if lr is None else {"lr": lr})
    return {
        "epoch": epoch,
        "metrics": metrics,
        "wall_s": 1.0 + rank,
        "elapsed_s": epoch * (1.0 + rank),
        "measured": measured,
        "method_stats": {"k": epoch},
        "peak_rss_mb": 100.0 + rank,
        "peak_gpu_mb": 0,
        "timed_by_script": timed,
        "backend": "gloo",
        "engine": "torch",
    }


@pytest.fixture
def script_cell(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    raw = {"workers": 2, "seeds": [0], "methods": TINY["methods"], "target_accuracy": 0.5}
    return cfg.SurveyConfig(cfg.script_mode(raw, str(path)) | {"script_args": ["--fast"]}).cells()[0]


def test_a_script_run_s_summary_line_keeps_its_keys_in_order(script_cell):
    reports = {rank: [_report(1, rank, lr=0.1), _report(2, rank, lr=0.05)] for rank in (0, 1)}
    summary = script.compose(script_cell, reports, "a1", "2020-01-01T00:00:00", "nccl", "cpu")
    epochs = summary.pop("_epochs")
    assert list(summary) == SCRIPT
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[0]["metrics"] == {"custom": 7.0}
    # bytes averaged over ranks per step; the wall time the slowest rank's
    assert summary["bytes_per_step"] == (40.0 + 80.0) / 2 / 5 and summary["compression_ratio"] == 60.0 / 400.0
    assert summary["train_time_s"] == 4.0 and summary["samples_per_s"] == 2 * 2 * 20.0 / 4.0
    assert (summary["batch_size"], summary["global_batch"], summary["steps_per_epoch"]) == (4, 8, 5)
    assert summary["epochs_to_target"] == 2 and summary["time_to_target_s"] == 4.0 and summary["lr"] == 0.05
    assert summary["compress_s"] == pytest.approx(0.15 / 5) and summary["wait_s"] == pytest.approx(0.5 / 5)
    assert summary["step_s"] == 2.0 / 5 and summary["compute_s"] == pytest.approx(2.0 / 5 - 0.5 / 5)
    assert summary["backend"] == "gloo" and summary["workload_description"] == "script train.py --fast"
    assert summary["timing"].startswith("wall time between reports")
    # without samples on every report: no sizes, no samples/s; timed by the script: said so
    reports = {rank: [_report(1, rank, samples=rank == 0, timed=True)] for rank in (0, 1)}
    summary = script.compose(script_cell, reports, "a2", "2020-01-01T00:00:00", "gloo", "cpu")
    assert summary["batch_size"] is summary["global_batch"] is summary["samples_per_s"] is None
    assert summary["timing"] == "the script's train_time_s"


def _epoch(number, accuracy, steps=4, **times):
    record = {
        "epoch": number,
        "steps": steps,
        "test_accuracy": accuracy,
        "test_loss": 1.0,
        "train_accuracy": 0.5,
        "train_loss": 1.5,
        "elapsed_s": 2.0 * number,
        "bytes_per_step": 10.0 * number,
        "dense_bytes_per_step": 100.0,
        "exchanges_per_step": 3,
        "groups_per_step": 1,
        "peak_rss_mb": 50.0 + number,
        "peak_gpu_mb": 0.0,
        "method_stats": {"n": number},
    }
    return record | dict.fromkeys(STEP_TIMES, 0.0) | times


def _parts(**changes):
    parts = dict(
        setup={"workload": "w"},
        steps_per_epoch=4,
        target_accuracy=0.5,
        samples_per_s=None,
        compression_ratio=0.25,
        device="cpu",
        backend="gloo",
        engine="torch",
        started="then",
        step_times=dict.fromkeys(STEP_TIMES, 1.0),
    )
    return SummaryParts(**(parts | changes))


def test_summary_record_from_its_parts(script_cell, monkeypatch):
    monkeypatch.setattr("grace_survey.running.summary.netem_shaping", lambda: {"tag": "shaped"})
    head = script_cell.record_head("a")
    epochs = [_epoch(1, None), _epoch(2, 0.6), _epoch(3, 0.4, steps=2)]
    summary = summary_record(head, script_cell, epochs, _parts())
    assert summary["steps"] == 10 and summary["epochs"] == 3
    assert summary["bytes_per_step"] == (10 * 4 + 20 * 4 + 30 * 2) / 10 and summary["dense_bytes_per_step"] == 100.0
    assert summary["best_test_accuracy"] == 0.6 and summary["final_test_accuracy"] == 0.4  # None: not scored
    assert summary["epochs_to_target"] == 2 and summary["time_to_target_s"] == 4.0 and summary["train_time_s"] == 6.0
    assert summary["peak_rss_mb"] == 53.0 and summary["method_stats"] == {"n": 3} and summary["shaping"]["tag"]
    assert datetime.datetime.fromisoformat(summary["finished"]) and summary["started"] == "then"
    assert "timing" not in summary and "launch" not in summary and "metrics" not in summary
    assert list(summary)[-len(STEP_TIMES) :] == list(STEP_TIMES)
    json.dumps(summary)
    # the optional parts go where the two kinds of run have always had them
    keys = list(summary_record(head, script_cell, epochs, _parts(timing="t", launch={"x": 1}, metrics={"m": 1})))
    assert keys.index("timing") == keys.index("engine") + 1 and keys.index("torch") == keys.index("timing") + 1
    assert keys.index("launch") == keys.index("python") + 1 and keys.index("started") == keys.index("launch") + 1
    assert keys.index("metrics") == keys.index("method_stats") + 1
    # no target: none reached
    summary = summary_record(head, script_cell, epochs, _parts(target_accuracy=None))
    assert summary["epochs_to_target"] is summary["time_to_target_s"] is None
    # a caller's part can never silently replace a figure the summary derives
    with pytest.raises(TypeError, match="steps"):
        summary_record(head, script_cell, epochs, _parts(setup={"steps": 1}))


def test_mean_step_times_weigh_the_epochs_by_their_steps():
    epochs = [_epoch(1, 0.1, compute_s=1.0, step_s=2.0), _epoch(2, 0.2, compute_s=4.0, step_s=8.0)]
    means = mean_step_times(epochs, [1, 3])
    assert list(means) == list(STEP_TIMES)
    assert means["compute_s"] == (1.0 + 12.0) / 4 and means["step_s"] == (2.0 + 24.0) / 4 and means["wait_s"] == 0.0
    assert mean_step_times(epochs, [0, 0])["compute_s"] == 0.0  # no steps: no division by zero
