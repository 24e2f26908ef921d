"""The survey measures faults (issue 57, item 4): a method's runs under torchft lose a replica
group at a step and take it back some steps later; the report sets each beside the same method
under torchft without the fault."""

from __future__ import annotations

import json
import textwrap

import pytest

from grace_dgc.errors import GraceConfigError
from grace_survey.config import settings as cfg
from grace_survey.config.cell import fingerprint
from grace_survey.report.writer import write_report
from grace_survey.running import runner

pytest.importorskip("torchft")

BASE = """
workload = "digits-mlp"
workers = 2
epochs = 2
max_steps = 8
"""


def config(tmp_path, text):
    path = tmp_path / "survey.toml"
    text = textwrap.dedent(text)
    given = {line.split("=")[0].strip() for line in text.splitlines() if "=" in line}
    base = [line for line in BASE.splitlines() if line.split("=")[0].strip() not in given]  # the text's own win
    path.write_text("\n".join(base) + "\n" + text)
    return cfg.load_config(str(path))


def test_faults_add_a_torchft_run_and_one_per_fault_for_every_method_alike(tmp_path):
    conf = config(
        tmp_path,
        """
        workers = [1, 2, 3]
        faults = [
            {group = 2, at_step = 4, back_after_steps = 4},
            {group = 1, at_step = 3, back_after_steps = 2, inside_exchange = true},
        ]
        [[methods]]
        compressor = "none"
        [[methods]]
        compressor = "topk"
        params = {compress_ratio = 0.1}
        faults = []
        """,
    )
    ids = [c.run_id for c in conf.cells()]
    faulted = [i for i in ids if "[" in i]
    # group 2 needs 3 workers, group 1 two; one worker has no survivor: no run under torchft there
    assert faulted == [
        "none w2 s0 [torchft]",
        "none w2 s0 [g1 lost 3-5 in exchange]",
        "none w3 s0 [torchft]",
        "none w3 s0 [g2 lost 4-8]",
        "none w3 s0 [g1 lost 3-5 in exchange]",
    ]
    assert len(ids) - len(faulted) == 6  # the usual runs, unchanged
    plain = next(c for c in conf.cells() if c.fault is None)
    hashed = {k: v for k, v in plain.as_dict().items() if k != "fault"}
    assert plain.cell_hash == fingerprint(hashed)  # the runs made before faults existed are reused


@pytest.mark.parametrize(
    "text, words",
    [
        ("workers = 2\nfaults = [{group = 2, at_step = 4, back_after_steps = 4}]", "group = 2, but the grid's workers"),
        ("faults = [{group = 0, at_step = 4, back_after_steps = 4}]", "group = 0 must be an int >= 1"),
        ("faults = [{group = 1, at_step = 4}]", "back_after_steps missing"),
        ("faults = [{group = 1, at_step = 4, back_after = 4}]", "did you mean 'back_after_steps'"),
        (
            "faults = [{group = 1, at_step = 4, back_after_steps = 4}]\n[[methods]]\ncompressor = 'none'\n"
            "tune_lr = [0.1, 0.2]",
            "faults and tune_lr together",
        ),
    ],
)
def test_a_fault_that_cannot_run_is_refused_by_name(tmp_path, text, words):
    if "[[methods]]" not in text:
        text += "\n[[methods]]\ncompressor = 'none'\n"
    with pytest.raises(GraceConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        config(tmp_path, text)


# a teacher task whose training forward takes 0.15 s, as a real step's compute does: time for the lost group to
# come back and heal while the job still runs
SLOW_WORKLOAD = """
import time

import torch
from grace_survey import Workload


class Slow(torch.nn.Sequential):
    def forward(self, x):
        if self.training:
            time.sleep(0.15)
        return super().forward(x)


def make(data_dir=None, seed=0):
    g = torch.Generator().manual_seed(7)
    x, xt = torch.randn(1280, 12, generator=g), torch.randn(200, 12, generator=g)
    return Workload(
        train=(x, (x[:, :3].sum(1) > 0).long()), test=(xt, (xt[:, :3].sum(1) > 0).long()),
        make_model=lambda: Slow(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
        batch_size=16, lr=0.2, epochs=1, description="teacher task, 0.15 s a step",
    )
"""


@pytest.mark.launches
def test_a_lost_group_comes_back_and_the_report_sets_the_run_beside_the_one_without_a_fault(tmp_path):
    """2 replica groups, top-k with error feedback: group 1 dies as the job reaches step 4 and
    comes back at step 8 of 40 (32 steps, 4.8 s, to rejoin: a busy machine took over 1.2 s, and
    over 3.2 s beside a suite of Triton's interpreter);
    group 0 trains on alone, the group heals and both end together. The report's faults
    section names the fault, the time lost and the metric."""
    (tmp_path / "slow.py").write_text(SLOW_WORKLOAD)
    conf = config(
        tmp_path,
        """
        workload = "slow.py:make"
        epochs = 1
        max_steps = 0
        faults = [{group = 1, at_step = 4, back_after_steps = 4}]
        [[methods]]
        label = "topk"
        compressor = "topk"
        memory = "residual"
        params = {compress_ratio = 0.1}
        """,
    )
    out = tmp_path / "out"
    summaries, failures = runner.run_grid(conf, str(out), progress=False, log=lambda *a: None)
    assert failures == []
    by_id = {s["run_id"]: s for s in summaries}
    assert sorted(by_id) == ["topk w2 s0", "topk w2 s0 [g1 lost 4-8]", "topk w2 s0 [torchft]"]
    faulted, clean = by_id["topk w2 s0 [g1 lost 4-8]"], by_id["topk w2 s0 [torchft]"]
    assert faulted["fault"] == "g1 lost 4-8" and faulted["fault_group"] == 1 and faulted["fault_at_step"] == 4
    assert faulted["groups_at_end"] == 2 and clean["groups_at_end"] == 2  # the lost group came back
    assert clean["discarded_steps"] == 0 and faulted["discarded_steps"] >= 0
    # group 0 applied every one of the job's 40 steps (a discarded one it took again)
    assert faulted["steps"] == 40 + faulted["discarded_steps"] and clean["steps"] == 40
    for summary in (faulted, clean):
        assert summary["final_test_accuracy"] > 0.75  # the teacher's sign of x0 + x1 + x2: chance is 0.5
    report = open(write_report(str(out))).read()
    section = report.split("## Faults", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| topk | 2 | g1 lost 4-8 |"))
    lost = faulted["train_time_s"] - clean["train_time_s"]
    assert f"{lost:+.1f}" in row and "1 of 1" in row, row
    records = [json.loads(line) for line in open(out / "results.jsonl")]
    assert {r["run_id"] for r in records if r.get("type") == "epoch"} >= set(by_id)
