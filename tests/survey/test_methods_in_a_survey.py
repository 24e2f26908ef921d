"""The library's methods and ways in as the survey runs them: a chain, the Adam schedules and
their report, the sharded example in script mode, a crafted dataset, the network shaping. Their
library halves are tested in tests/core and tests/training, which import no survey."""

import math
import os

import pytest
import torch
from test_adam import Tiny
from test_faults import _Exploit

from grace_dgc.errors import GraceConfigError

# -- a chain (from test_chain.py) --


def test_a_survey_method_names_a_chain():
    from grace_survey.config.settings import SurveyConfig

    raw = {
        "name": "t",
        "workload": "mnist1d-mlp",
        "methods": [
            {"label": "topk>qsgd", "compressor": "topk>qsgd", "memory": "residual", "params": {"quantum_num": 3}}
        ],
    }
    method = SurveyConfig(raw).methods[0]
    assert method["compressor"] == "topk>qsgd" and method["communicator"] == "allgather"


# -- the Adam schedules (from test_adam.py) --


def test_the_lr_schedule_is_nanogpts_warm_up_and_cosine():
    import math

    from grace_survey.running.train import lr_at
    from grace_survey.workloads.registry import Workload

    def workload(**hyper):
        return Workload(
            train=(torch.zeros(1), torch.zeros(1)), test=(torch.zeros(1), torch.zeros(1)), make_model=Tiny, **hyper
        )

    cosine = workload(lr_schedule="cosine", warmup_steps=10)
    total, lr = 110, 1e-3
    assert [lr_at(cosine, lr, 0, s, total) for s in (0, 4, 9)] == [lr * 1 / 11, lr * 5 / 11, lr * 10 / 11]
    assert lr_at(cosine, lr, 0, 10, total) == lr  # the peak, then cosine down to lr / 10
    assert math.isclose(lr_at(cosine, lr, 0, 60, total), lr / 10 + 0.5 * (lr - lr / 10))
    assert math.isclose(lr_at(cosine, lr, 0, 110, total), lr / 10)
    steps = workload(lr_milestones=(2,), lr_gamma=0.5)  # the default: milestones, unchanged
    assert [lr_at(steps, 0.1, e, 0, 10) for e in (0, 1, 2)] == [0.1, 0.1, 0.05]


def test_pydoc_gpt_trains_with_adamw_and_bad_values_are_refused():
    from grace_survey.running.train import make_optimizer
    from grace_survey.workloads.registry import get_workload

    gpt = get_workload("pydoc-gpt", train_chars=1000, d_model=16, n_layer=1, n_head=2)
    assert (gpt.optimizer, gpt.lr, gpt.betas, gpt.weight_decay) == ("adamw", 1e-3, (0.9, 0.99), 0.1)
    assert (gpt.lr_schedule, gpt.warmup_steps, gpt.grad_clip) == ("cosine", 100, 1.0)
    adamw = make_optimizer(gpt, gpt.make_model(), gpt.lr)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.9, 0.99)
    sgd = get_workload("pydoc-gpt", train_chars=1000, d_model=16, n_layer=1, n_head=2, optimizer="sgd")
    assert isinstance(make_optimizer(sgd, sgd.make_model(), 0.1), torch.optim.SGD)
    for bad, match in (
        ({"optimizer": "lion"}, "optimizer='lion'; accepted: sgd, adamw"),
        ({"lr_schedule": "linear"}, "accepted: step, cosine"),
        ({"betas": [0.9]}, "two numbers"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ):
        with pytest.raises(GraceConfigError, match=match):
            get_workload("pydoc-gpt", train_chars=1000, **bad)


def test_the_adam_schedules_by_name_in_a_survey_config():
    from grace_survey.config.settings import SurveyConfig

    method = {
        "label": "1-bit adam",
        "compressor": "efsignsgd",
        "memory": "residual",
        "communicator": "reduce_scatter",
        "params": {"scale": "rms"},
    }
    raw = {
        "name": "t",
        "workload": "mnist1d-mlp",
        "optimizer": "adamw",
        "lr_schedule": "cosine",
        "warmup_steps": 5,
        "methods": [dict(method, schedule={"name": "onebit_adam", "freeze_step": 20})],
    }
    config = SurveyConfig(raw)
    assert config.methods[0]["schedule"] == {"name": "onebit_adam", "params": {"freeze_step": 20}}
    assert config.hyper["optimizer"] == "adamw"
    bad = dict(raw, methods=[dict(method, schedule={"name": "zero_one_adam", "freeze_step": 20})])
    with pytest.raises(GraceConfigError, match="freeze_step"):  # 0/1 Adam's is var_freeze_step
        SurveyConfig(bad)


def test_the_report_shows_the_loss_gap_to_dense_in_nats():
    import statistics

    from scipy import stats

    from grace_survey.report import Group, general_table, loss_gap

    def group(label, compressor, losses, seeds=(0, 1, 2)):
        g = Group(label, 2, "local")
        measured = {"peak_rss_mb": 500.0, "compression_ratio": 1.0, "bytes_per_step": 4.0}
        g.runs = [
            {"compressor": compressor, "seed": seed, "final_test_loss": v, "loss": "lm", "final_test_accuracy": 0.5}
            | measured
            for seed, v in zip(seeds, losses)
        ]
        return g

    base, mine = [1.2, 1.25, 1.22], [1.24, 1.27, 1.25]
    dense, adam, ef = group("dense", "none", base), group("1-bit", "efsignsgd", mine), group("topk", "topk", [2.1])
    other_seeds = group("qsgd", "qsgd", mine, seeds=(3, 4, 5))
    groups = [dense, adam, ef, other_seeds]
    gap = statistics.mean(mine) - statistics.mean(base)
    # the same seeds: the paired interval, t on the per-seed differences (written out here)
    differences = [a - b for a, b in zip(mine, base)]
    half = stats.t.ppf(0.975, 2) * statistics.stdev(differences) / math.sqrt(3)
    assert loss_gap(adam, groups) == f"{gap:+.3f} [{gap - half:+.3f}, {gap + half:+.3f}] paired"
    # other seeds: Welch's interval
    welch = stats.ttest_ind(mine, base, equal_var=False).confidence_interval(0.95)
    assert loss_gap(other_seeds, groups) == f"{gap:+.3f} [{welch.low:+.3f}, {welch.high:+.3f}]"
    assert loss_gap(dense, groups) == "(baseline)"
    assert loss_gap(ef, groups).startswith(f"{2.1 - statistics.mean(base):+.3f} (too few seeds")
    assert "Loss gap to baseline (nats)" in general_table(groups)


# -- FSDP2 in script mode (from test_fsdp.py) --


def test_script_mode_runs_the_sharded_example_through_the_report(tmp_path, capsys):
    """examples/survey_fsdp.py under the survey: the anchor (torch's bf16 reduction) and fp8 on
    FSDP2's reduce-scatter, bytes per rank and step as FSDP moves them."""
    import os

    from grace_survey import cli
    from grace_survey.running.results import read_records

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    conf = tmp_path / "methods.toml"
    rows = [("anchor", "none", 'tags = {reduce_dtype = "bf16"}\n'), ("fp8", "fp8", "")]
    conf.write_text(
        "workers = 2\nseeds = [0]\n"
        + "".join(
            f'[[methods]]\nlabel = "{label}"\ncompressor = "{name}"\ncommunicator = "reduce_scatter"\n{extra}'
            for label, name, extra in rows
        )
    )
    out = str(tmp_path / "out")
    example = os.path.join(root, "examples", "survey_fsdp.py")
    code = cli.main(["survey", "--script", example, "--config", str(conf), "--out", out, "--no-progress",
                     "--script-args", "--steps", "3", "--train-chars", "20000"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    summaries = {r["label"]: r for r in read_records(out) if r["type"] == "summary"}
    anchor, fp8 = summaries["anchor"], summaries["fp8"]
    # bf16 halves fp32's (N−1)/N; fp8 is a byte per element plus scales and headers
    assert anchor["compression_ratio"] == pytest.approx(0.25)
    assert 0.125 < fp8["compression_ratio"] < 0.14
    assert fp8["metrics"]["shard_bytes_per_step"] == pytest.approx(fp8["bytes_per_step"])
    assert "fp8" in open(os.path.join(out, "report.md")).read()


# -- a crafted dataset (from test_faults.py) --


def test_a_crafted_cifar_batch_is_refused_not_run(tmp_path, monkeypatch):
    import pickle

    from grace_survey.workloads import datasets

    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Exploit(), b"labels": [0]}, protocol=2))
    called = []
    monkeypatch.setattr(os, "system", lambda command: called.append(command))
    with pytest.raises(ValueError, match=r"not a CIFAR-10 batch \(refusing .*system"):
        datasets._cifar_batch(str(path))
    assert called == []


# -- network shaping (from test_declarations.py) --


def test_a_bad_netem_setting_is_named(monkeypatch):
    from grace_survey.running import netem

    monkeypatch.setenv("GRACE_DGC_NETEM", "{not json")
    with pytest.raises(GraceConfigError, match=r"^GRACE_DGC_NETEM='\{not json' in the environment"):
        netem.current_shaping()
