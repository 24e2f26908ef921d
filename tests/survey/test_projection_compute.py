"""`grace-dgc project` separates what a method changes from what the machine did (issue 56,
point 2): every method of a workload is projected on the same compute, the median of all its
runs, with each method's own measurement shown beside it and flagged when it lies outside
the runs' noise; the ranking then follows the exchange alone.

Synthetic summaries here, where the answer is known by hand; the survey recorded quiet and
beside a busy neighbour is in test_projection_recorded.py."""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_survey import cli
from grace_survey.projection import project

METHODS = {  # label: (compressor, communicator, bytes per step, compress s, decompress s)
    "dense": ("none", "allreduce", 400_000.0, 0.0, 0.0),
    "topk": ("topk", "allgather", 8_000.0, 0.0004, 0.0002),
    "qsgd": ("qsgd", "allgather", 60_000.0, 0.0006, 0.0003),
}


def summary(label, seed, compute_s, workload="mnist1d-mlp", workers=2, **extra):
    compressor, communicator, nbytes, compress, decompress = METHODS[label]
    record = {
        "type": "summary",
        "run_id": f"{label} {workload} w{workers} s{seed}",
        "label": label,
        "compressor": compressor,
        "memory": "none",
        "communicator": communicator,
        "params": {},
        "workers": workers,
        "seed": seed,
        "network": "local",
        "workload": workload,
        "batch_size": 32,
        "device": "cpu",
        "bytes_per_step": nbytes,
        "dense_bytes_per_step": 400_000.0,
        "exchanges_per_step": 4,
        "groups_per_step": 1,
        "compute_s": compute_s,
        "compress_s": compress,
        "communicate_s": 0.001,
        "decompress_s": decompress,
    }
    record.update(extra)
    return record


def by_label(methods):
    return {m["label"]: m for m in methods}


def test_every_method_is_projected_on_the_median_compute_of_the_workloads_runs():
    computes = {"dense": (0.0025, 0.0030), "topk": (0.0116, 0.0042), "qsgd": (0.0094, 0.0028)}
    records = [summary(label, seed, c) for label, pair in computes.items() for seed, c in enumerate(pair)]
    methods = by_label(project.measured_methods(records))
    median = statistics.median(c for pair in computes.values() for c in pair)  # of all six runs
    for label, pair in computes.items():
        assert methods[label]["compute_s"] == pytest.approx(median)
        assert methods[label]["own_compute_s"] == pytest.approx(sum(pair) / 2)
    reference = methods["dense"]["compute"]
    assert (reference["min_s"], reference["max_s"], reference["runs"]) == (0.0025, 0.0116, 6)
    # the same compute in the dense baseline and in each method: the speedup is the exchange's alone
    rows = project.project(list(methods.values()), [16], [10e9], 0.1)
    without = project.project([dict(m, compute_s=0.0) for m in methods.values()], [16], [10e9], 0.1)
    for row, exchange in zip(rows, without):
        assert row["step_s"] == pytest.approx(median + exchange["step_s"])
        assert row["dense_step_s"] == pytest.approx(median + exchange["dense_step_s"])
    assert {r["label"]: r["speedup"] for r in rows}["dense"] == pytest.approx(1.0)


def test_a_method_whose_own_compute_is_outside_the_runs_noise_is_flagged_and_shown():
    quiet = [0.0040, 0.0041, 0.0039, 0.0040, 0.0042]
    records = [summary("dense", s, c) for s, c in enumerate(quiet)]
    records += [summary("topk", s, c) for s, c in enumerate(quiet)]
    records += [summary("qsgd", 0, 0.0094)]  # one run beside a busy neighbour
    methods = by_label(project.measured_methods(records))
    assert methods["qsgd"]["compute_flagged"] and not methods["dense"]["compute_flagged"]
    assert not methods["topk"]["compute_flagged"]
    lines = "\n".join(project.compute_lines(list(methods.values())))
    assert "the median of the workload's 11 run(s) at 2 workers" in lines
    assert "qsgd (9.40 ms)" in lines and "topk" not in lines.split("⚠")[1]
    table = project.format_table(project.project(list(methods.values()), [8], [1e9], 0.1))
    assert "| 9.40 ms ⚠ outside the runs' noise |" in table


def test_workloads_and_worker_counts_each_have_their_own_compute():
    records = [summary("dense", 0, 0.004), summary("topk", 0, 0.006)]
    records += [summary("dense", 0, 0.100, workload="gpt"), summary("topk", 0, 0.120, workload="gpt")]
    methods = project.measured_methods(records)
    # labels are the survey's; each label's runs here are of two workloads: the largest
    # worker count is kept per label, and each run's workload gives its compute
    shared = project.shared_compute(records)
    assert shared[("mnist1d-mlp", 32, 2, "cpu")]["median_s"] == pytest.approx(0.005)
    assert shared[("gpt", 32, 2, "cpu")]["median_s"] == pytest.approx(0.110)
    assert {m["label"] for m in methods} == {"dense", "topk"}


@settings(max_examples=40, deadline=None)
@given(
    noise=st.lists(st.floats(min_value=0.25, max_value=4.0), min_size=6, max_size=6),
    bandwidth=st.sampled_from([1e9, 10e9]),
    nodes=st.sampled_from([8, 16, 64]),
)
def test_the_ranking_does_not_follow_the_machines_noise(noise, bandwidth, nodes):
    """Any per-run compute (each run's 0.25–4× of 4 ms) gives the ranking of the exchange alone."""
    records = [summary(label, seed, 0.004 * noise[2 * i + seed]) for i, label in enumerate(METHODS) for seed in (0, 1)]
    rows = project.project(project.measured_methods(records), [nodes], [bandwidth], 0.1)
    quiet = [summary(label, seed, 0.004) for label in METHODS for seed in (0, 1)]
    reference = project.project(project.measured_methods(quiet), [nodes], [bandwidth], 0.1)

    def ranking(rows):
        return sorted(r["label"] for r in rows), [r["label"] for r in sorted(rows, key=lambda r: -r["speedup"])]

    assert ranking(rows) == ranking(reference)


def test_the_projection_file_states_its_compute_and_the_busy_machine_warning(tmp_path, capsys):
    busy = {"launcher": "pool", "cores": 2, "threads": [1], "threads_other": [1], "others_share": 0.6}
    records = [summary(label, s, 0.004 + 0.001 * s, launch=busy) for label in METHODS for s in (0, 1)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.project_main([str(tmp_path), "--nodes", "8", "--bandwidth", "1gbit"]) == 0
    text = (tmp_path / "projection.md").read_text()
    assert "every method is projected on the same forward + backward, 4.50 ms" in text
    assert "trained on a busy machine" in text
    assert "Own measured compute" in text and "Own measured compute" in capsys.readouterr().out


def test_the_projection_reads_the_grid_the_last_survey_ran_as_the_report_does(tmp_path):
    """A run of earlier settings (before --epochs changed, say) is no part of the projection."""
    records = [summary(label, 0, 0.004, cell_hash="now") for label in METHODS]
    records.append(summary("topk", 1, 0.004, cell_hash="before", bytes_per_step=1e9))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    grid = {r["run_id"]: "now" for r in records[:3]} | {records[3]["run_id"]: "changed"}
    (tmp_path / "survey_grid.json").write_text(json.dumps({"runs": grid}))
    assert cli.project_main([str(tmp_path), "--nodes", "8", "--bandwidth", "1gbit"]) == 0
    text = (tmp_path / "projection.md").read_text()
    assert "the median of the workload's 3 run(s)" in text and "953.67 MB" not in text and "7.81 KB" in text
