"""The projection on two recorded surveys of the same workload (issue 56, point 2): the quick
preset (dense, top-k 1 %, DGC 0.1 %, QSGD 64, 2-bit; MNIST-1D, 2 ranks, seeds 0 and 1, 3 epochs),
run once on a quiet machine and once beside three busy-looping processes (the runs record the
other processes at 65–74 % of the machine). Forward + backward measured 2.2–6.0 ms quiet and
3.5–13.8 ms busy; the projection on the workload's shared compute ranks the methods alike."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from grace_survey import cli
from grace_survey.projection import project

DATA = Path(__file__).parent / "data"


def methods(kind):
    lines = (DATA / f"quick-2seeds-{kind}.jsonl").read_text().splitlines()
    return project.measured_methods([json.loads(line) for line in lines])


def ranking(ms, nodes, bandwidth):
    rows = project.project(ms, [nodes], [bandwidth], 0.1)
    return [r["label"] for r in sorted(rows, key=lambda r: -r["speedup"])]


@pytest.mark.parametrize("nodes, bandwidth", list(itertools.product([8, 16, 64], [1e9, 10e9])))
def test_a_quiet_and_a_busy_survey_project_the_same_ranking(nodes, bandwidth):
    quiet, busy = methods("quiet"), methods("busy")
    assert ranking(quiet, nodes, bandwidth) == ranking(busy, nodes, bandwidth)


def test_the_recorded_surveys_differ_in_compute_and_the_projection_says_so(tmp_path):
    quiet, busy = methods("quiet")[0]["compute"], methods("busy")[0]["compute"]
    assert busy["median_s"] > 1.5 * quiet["median_s"]  # the neighbours' load is in every run's compute
    shutil.copy(DATA / "quick-2seeds-busy.jsonl", tmp_path / "results.jsonl")
    assert cli.project_main([str(tmp_path), "--nodes", "16", "--bandwidth", "10gbit"]) == 0
    text = (tmp_path / "projection.md").read_text()
    assert "the median of the workload's 10 run(s) at 2 workers" in text
    assert "10 run(s) trained on a busy machine" in text
