"""Script mode through the trainers (issue 44): ``grace-dgc survey --script`` runs the Lightning
and the Accelerate examples, the cell's method reaching them through ``survey_strategy`` /
``survey_attach`` and the metrics through ``SurveyReporter`` / ``survey_log``, end to end
through the report."""

from __future__ import annotations

import os

import pytest

from grace_survey import cli
from grace_survey.running.results import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = (
    'workers = 2\nseeds = [0]\ntarget_accuracy = 0.3\n[[methods]]\nlabel = "topk"\ncompressor = "topk"\n'
    'memory = "residual"\ncommunicator = "allgather"\nparams = {compress_ratio = 0.05}\n'
)


@pytest.mark.parametrize(
    ("script", "package"), [("survey_lightning.py", "lightning"), ("survey_accelerate.py", "accelerate")]
)
def test_a_trainer_script_runs_as_a_survey_cell_through_its_integration(tmp_path, capsys, script, package):
    pytest.importorskip(package)
    conf = tmp_path / "methods.toml"
    conf.write_text(CONFIG)
    out = str(tmp_path / "out")
    code = cli.main(["survey", "--script", os.path.join(ROOT, "examples", script), "--config", str(conf),
                     "--out", out, "--no-progress", "--script-args", "--epochs", "2"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    records = read_records(out)
    (summary,) = [r for r in records if r["type"] == "summary"]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert summary["label"] == "topk" and summary["compressor"] == "topk"
    assert 0 < summary["compression_ratio"] < 0.5  # the cell's method ran, not the script's fallback
    assert summary["final_test_accuracy"] > 0.3 and [e["epoch"] for e in epochs] == [1, 2]
    with open(os.path.join(out, "report.md")) as f:
        assert "topk" in f.read()
