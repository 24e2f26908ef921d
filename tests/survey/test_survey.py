"""The survey: config validation, a tiny end-to-end grid on 2 gloo ranks (every output file
and field, resumability), determinism of a run, the report on a fixture directory, the
projection model against hand-computed numbers, and the CLI wiring."""

import argparse
import csv
import json
import math
import os

import pytest

from grace_dgc.errors import GraceConfigError
from grace_survey import cli, report
from grace_survey.config import settings as cfg
from grace_survey.projection import project
from grace_survey.running import runner
from grace_survey.units import human_bytes, parse_latency, parse_rate

TINY = {
    "name": "tiny",
    "workload": "digits-mlp",
    "workers": 2,
    "epochs": 1,
    "workload_options": {"train_samples": 512, "test_samples": 200},
    "methods": [
        {"label": "dense", "compressor": "none"},
        {
            "label": "topk 1%",
            "compressor": "topk",
            "memory": "residual",
            "communicator": "allgather",
            "params": {"compress_ratio": 0.01},
            "tune_lr": [0.05, 0.1],
            "tags": {"kpercent": 1},
            "fusion_bytes": 0,  # one exchange per tensor (dense: the default 4 MiB, one group)
        },
    ],
}
# digits-mlp is 64-128-10: tensors of 8192, 128, 1280 and 10 elements
TENSORS = (64 * 128, 128, 128 * 10, 10)


def topk_bytes(ratio):
    """allgather of top-k: per tensor an int64 size header per payload tensor (values,
    indices) and k fp32 values + k int32 indices."""
    return sum(2 * 8 + max(1, int(n * ratio)) * (4 + 4) for n in TENSORS)


# -- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        ({"wrokers": 2}, "unknown key(s) 'wrokers'"),
        ({"workers": 0}, "workers = 0 must be an int >= 1"),
        ({"workers": "2"}, "workers = '2' must be an int or list"),
        ({"workload": "mnist1d-mpl"}, "Did you mean 'mnist1d-mlp'"),
        ({"epochs": 0}, "epochs=0 is out of range"),
        ({"seeds": [0, 0]}, "distinct"),
        ({"seeds": [0, 1], "repeats": 3}, "give one"),
        ({"device": "tpu"}, "accepted: auto, cpu, cuda"),
        ({"tune_holdout": 1.5}, "tune_holdout"),
        ({"networks": [{"bandwidth": "1gbps"}]}, "bytes per second"),
        ({"networks": [{"bandwith": "1gbit"}]}, "unknown key(s) 'bandwith' in networks[0]"),
        ({"methods": []}, "no methods"),
        ({"methods": [{"compressor": "topkk"}]}, "unknown compressor 'topkk'. Did you mean 'topk'"),
        ({"methods": [{"compressor": "topk", "params": {"ratio": 0.1}}]}, "unknown parameter 'ratio'"),
        ({"methods": [{"compressor": "topk", "params": {"compress_ratio": 2}}]}, "compress_ratio=2 is out of range"),
        ({"methods": [{"compressor": "qsgd", "communicator": "allreduce"}]}, "cannot be summed"),
        ({"methods": [{"compressor": "none"}, {"compressor": "none"}]}, "used twice"),
        ({"methods": [{"compressor": "none", "lr": 0.1, "tune_lr": [0.1]}]}, "not both"),
        ({"methods": [{"compressor": "none", "tune_lr": []}]}, "tune_lr"),
        ({"methods": [{"compressor": "none", "colour": 1}]}, "unknown key(s) 'colour' in methods[0]"),
        (
            {"methods": [{"compressor": "none", "fusion_bytes": -1}]},
            "methods[0]: fusion_bytes = -1 must be an int >= 0",
        ),
        ({"methods": [{"compressor": "none", "fusion_bytes": 1.5}]}, "fusion_bytes = 1.5 must be an int"),
    ],
)
def test_config_errors_name_the_problem(change, message):
    raw = dict(TINY, **change)
    with pytest.raises(GraceConfigError) as err:
        cfg.SurveyConfig(raw)
    assert message in str(err.value)


def test_config_grid_defaults_presets_and_toml(tmp_path):
    conf = cfg.SurveyConfig(dict(TINY, workers=[1, 2], repeats=2, networks=[{}, {"bandwidth": "1gbit"}]))
    cells = conf.cells()
    assert len(cells) == 2 * 2 * 2 * 2
    assert {c["run_id"] for c in cells} >= {"dense w1 s0", "topk 1% w2 s1 @1gbit"}
    assert len({c["run_id"] for c in cells}) == len(cells)
    dense = next(c for c in cells if c["label"] == "dense")
    assert dense["method"]["communicator"] == "allreduce" and dense["method"]["memory"] == "none"
    # the seeds of a (method, workers, network) share lr tuning; any change moves the run's hash
    a, b = (c for c in cells if c["label"] == "topk 1%" and c["workers"] == 2 and c["network"]["tag"] == "local")
    assert a["tuning_key"] == b["tuning_key"] and a["cell_hash"] != b["cell_hash"]
    other = cfg.SurveyConfig(dict(TINY, epochs=2)).cells()[0]
    assert other["cell_hash"] != cfg.SurveyConfig(TINY).cells()[0]["cell_hash"]
    # presets and the shipped TOML files load and validate
    assert [m["label"] for m in cfg.load_preset("quick").methods] == [
        "dense",
        "topk 1%",
        "dgc 0.1%",
        "qsgd 64",
        "twobit 0.005",
    ]
    kp = cfg.load_preset("seed000-kpercent")
    assert [m["tags"]["kpercent"] for m in kp.methods] == list(cfg.KPERCENTS) and kp.workers == [1, 2]
    assert cfg.load_preset("seed000-kpercent", "/data").workload == "mnist-mlp"
    assert cfg.load_preset("seed004-twobit").networks[1].bandwidth_bps == 1e9
    for name in cfg.PRESETS:
        cfg.load_preset(name)
    here = os.path.dirname(__file__)
    for name in ("example.toml", "fc-heavy-dgc.toml"):
        cfg.load_config(os.path.join(here, "..", "..", "benchmarks", "configs", name))
    bad = tmp_path / "bad.toml"
    bad.write_text("workload = 'digits-mlp'\n[[methods]]\ncompressor = \n")
    with pytest.raises(GraceConfigError, match="not valid TOML"):
        cfg.load_config(str(bad))
    over = cfg.with_overrides(conf, workers=4, epochs=3, network={"bandwidth": "10mbit"})
    assert over.workers == [4] and over.hyper["epochs"] == 3 and [n.tag for n in over.networks] == ["10mbit"]


def test_units():
    assert parse_rate("1gbit") == 1e9 and parse_rate("10Mbit") == 1e7 and parse_rate(2500) == 2500
    for bad in ("fast", "1gbps", "-1mbit", "0mbit"):
        with pytest.raises(GraceConfigError):
            parse_rate(bad)
    assert parse_latency("0.1") == 0.1 and parse_latency("2ms") == 2.0
    with pytest.raises(GraceConfigError):
        parse_latency("-1")
    assert human_bytes(1536) == "1.5 KB" and human_bytes(100) == "100 B"


# -- end to end ------------------------------------------------------------------------------
EPOCH_FIELDS = {
    "run_id",
    "attempt",
    "label",
    "workers",
    "seed",
    "network",
    "type",
    "epoch",
    "lr",
    "steps",
    "train_loss",
    "train_accuracy",
    "test_loss",
    "test_accuracy",
    "epoch_time_s",
    "elapsed_s",
    "samples_per_s",
    "bytes_per_step",
    "dense_bytes_per_step",
    "compression_ratio",
    "exchanges_per_step",
    "groups_per_step",
    "timed_steps",
    "peak_rss_mb",
    "peak_gpu_mb",
    "method_stats",
    "compute_s",
    "compress_s",
    "communicate_s",
    "decompress_s",
    "wait_s",
    "step_s",
}


def test_tiny_survey_end_to_end_and_resume(tmp_path):
    out = str(tmp_path / "run")
    conf = cfg.SurveyConfig(TINY)
    summaries, failures = runner.run_grid(conf, out, progress=False, log=lambda *a: None)
    assert failures == [] and len(summaries) == 2
    for name in ("results.jsonl", "summary.csv", "survey_config.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    records = runner.read_records(out)
    epochs = [r for r in records if r["type"] == "epoch"]
    sums = {r["label"]: r for r in records if r["type"] == "summary"}
    tuning = [r for r in records if r["type"] == "tuning"]
    assert len(epochs) == 2 and set(sums) == {"dense", "topk 1%"} and len(tuning) == 1
    for e in epochs:
        assert set(e) == EPOCH_FIELDS
        assert 0 <= e["test_accuracy"] <= 1 and 0 <= e["train_accuracy"] <= 1 and e["test_loss"] > 0
        assert e["steps"] == 512 // 64 and e["timed_steps"] == e["steps"] - 1
        assert e["compute_s"] > 0 and e["step_s"] >= e["compute_s"] and e["samples_per_s"] > 0
        assert e["peak_rss_mb"] > 50 and e["exchanges_per_step"] == 4
        assert e["groups_per_step"] == (1 if e["label"] == "dense" else 4)
    dense, topk = sums["dense"], sums["topk 1%"]
    # bytes as measured by grace.stats(), against the wire format computed here
    assert dense["bytes_per_step"] == dense["dense_bytes_per_step"] == 4 * sum(TENSORS)
    assert dense["compression_ratio"] == 1.0
    assert topk["bytes_per_step"] == topk_bytes(0.01)
    assert topk["compression_ratio"] == pytest.approx(topk_bytes(0.01) / (4 * sum(TENSORS)))
    for s in (dense, topk):
        assert s["steps"] == 8 and s["global_batch"] == 64 and s["batch_size"] == 32 and s["workers"] == 2
        assert s["parameters"] == sum(TENSORS) and s["device"] == "cpu" and s["backend"] == "gloo"
        assert s["final_test_accuracy"] == s["best_test_accuracy"]
        assert (s["epochs_to_target"] is None) == (s["time_to_target_s"] is None)
        for key in ("compute_s", "compress_s", "communicate_s", "decompress_s", "step_s", "train_time_s"):
            assert s[key] > 0, key
    assert dense["lr"] == 0.05 and dense["lr_tuning"] is None
    t = topk["lr_tuning"]
    assert t["chosen_lr"] == topk["lr"] and [c["lr"] for c in t["candidates"]] == [0.05, 0.1]
    assert t["holdout_size"] == round(512 * 0.1) and t["train_size"] == 512 - t["holdout_size"]
    best = max(t["candidates"], key=lambda c: (c["heldout_accuracy"], -c["heldout_loss"]))
    assert t["chosen_lr"] == best["lr"]
    with open(os.path.join(out, "summary.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["dense", "topk 1%"] and set(runner.SUMMARY_COLUMNS) == set(rows[0])
    assert json.loads(rows[1]["params"]) == {"compress_ratio": 0.01}
    with open(os.path.join(out, "survey_config.json")) as f:
        assert cfg.SurveyConfig(json.load(f)).cells()[0]["cell_hash"] == conf.cells()[0]["cell_hash"]

    # resumable: a second call finds both summaries and trains nothing
    lines = open(os.path.join(out, "results.jsonl")).read()
    again, failures = runner.run_grid(conf, out, progress=False)
    assert again == [] and failures == []
    assert open(os.path.join(out, "results.jsonl")).read() == lines

    # the report over the real results
    path = report.write_report(out)
    text = open(path).read()
    assert "| dense | 2 | local | 1 |" in text and "Send k% grads" in text and "0.05: " in text
    for png in ("accuracy_loss.png", "accuracy_vs_ratio.png", "time_split.png"):
        assert_png(os.path.join(out, png))


def test_pooled_ranks_give_the_fresh_ranks_results_bit_for_bit(tmp_path):
    """The survey's default (one RankPool per world size, kept up across runs) against ranks
    started for every run: every number that does not measure time is equal, and each summary
    names how its ranks were launched. A third method after the tuned one checks that nothing
    of an earlier run (its RNG draws, its thread settings) leaks into the next."""
    conf = dict(TINY, methods=TINY["methods"] + [{"label": "dense again", "compressor": "none", "lr": 0.07}])
    outs = {}
    for fresh in (True, False):
        out = str(tmp_path / ("fresh" if fresh else "pooled"))
        summaries, failures = runner.run_grid(
            cfg.SurveyConfig(conf), out, progress=False, log=lambda *a: None, fresh_ranks=fresh
        )
        assert failures == [] and len(summaries) == 3
        outs[fresh] = runner.read_records(out)
    exact = (
        "final_test_accuracy",
        "final_test_loss",
        "final_train_loss",
        "final_train_accuracy",
        "bytes_per_step",
        "compression_ratio",
        "lr",
        "lr_tuning",
        "steps",
        "best_test_accuracy",
        "cell_hash",
        "method_stats",
    )
    timeless = ("train_loss", "test_loss", "test_accuracy", "train_accuracy", "bytes_per_step", "epoch")

    def numbers(records, kind, fields):
        return [{f: r.get(f) for f in fields} for r in records if r["type"] == kind]

    def untimed(stats):  # grace.stats() of a run: its counts, without its seconds
        return {k: v for k, v in stats.items() if not k.endswith("_s")} if isinstance(stats, dict) else stats

    fresh, pooled = outs[True], outs[False]
    for a, b in zip(numbers(fresh, "summary", exact), numbers(pooled, "summary", exact)):
        a["method_stats"], b["method_stats"] = untimed(a["method_stats"]), untimed(b["method_stats"])
        assert a == b
    assert numbers(fresh, "epoch", timeless) == numbers(pooled, "epoch", timeless)
    assert {r["launch"]["launcher"] for r in fresh if r["type"] == "summary"} == {"survey"}
    assert {r["launch"]["launcher"] for r in pooled if r["type"] == "summary"} == {"survey-pool"}


def test_a_schedule_runs_in_the_survey_and_its_bytes_are_per_step(tmp_path):
    """local_sgd every 3 of the 8 steps, plus the epoch's closing synchronization: 3 dense
    exchanges of the model in 8 steps, so 3/8 of a step-by-step allreduce's bytes."""
    raw = dict(
        TINY,
        methods=[
            {
                "label": "local sgd H=3",
                "compressor": "none",
                "schedule": {"name": "local_sgd", "inner_steps": 3},
            }
        ],
    )
    conf = cfg.SurveyConfig(raw)
    assert conf.cells()[0].method["schedule"] == {"name": "local_sgd", "params": {"inner_steps": 3}}
    summaries, failures = runner.run_grid(conf, str(tmp_path / "run"), progress=False, log=lambda *a: None)
    assert failures == [] and len(summaries) == 1
    (summary,) = summaries
    assert summary["dense_bytes_per_step"] == 4 * sum(TENSORS)
    assert summary["bytes_per_step"] == pytest.approx(3 * 4 * sum(TENSORS) / 8)
    assert summary["compression_ratio"] == pytest.approx(3 / 8)
    assert summary["groups_per_step"] == pytest.approx(3 / 8) and 0 <= summary["final_test_accuracy"] <= 1


@pytest.mark.parametrize(
    "schedule, message",
    [
        ({"inner_steps": 3}, "schedule must be a table with a name"),
        ({"name": "dilocco"}, "Did you mean 'diloco'"),
        ({"name": "diloco", "inner_steps": 0}, "inner_steps=0 is out of range"),
        ({"name": "diloco", "outer_lr": -1}, "outer_lr"),
        ({"name": "diloco", "fusion_bytes": 0}, "give fusion_bytes on the method"),
        ({"name": "diloco", "h": 5}, "unknown parameter 'h'"),
    ],
)
def test_a_bad_schedule_is_named_before_any_rank_starts(schedule, message):
    raw = dict(TINY, methods=[{"label": "s", "compressor": "none", "schedule": schedule}])
    with pytest.raises(GraceConfigError, match=message):
        cfg.SurveyConfig(raw)


def test_a_run_is_deterministic(tmp_path):
    """One process (local engine): the same cell twice gives the same numbers (seeded init,
    seeded data order); the seeded init is what every method starts from."""
    import torch

    conf = cfg.SurveyConfig(dict(TINY, workers=1, workload_options={"train_samples": 256, "test_samples": 100}))
    ctx = runner.Context.detect("cpu")
    assert ctx.engine_kind == "local" and ctx.size == 1
    dense = conf.cells(cache_dir=str(tmp_path))[0]
    results = []
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        results.append(runner.execute_cell(ctx, dense, str(tmp_path / name), progress=False))
    for key in ("final_train_loss", "final_test_loss", "final_test_accuracy", "bytes_per_step"):
        assert results[0][key] == results[1][key]
    assert results[0]["engine"] == "local" and results[0]["bytes_per_step"] == 4 * sum(TENSORS)
    workload = runner.load_workload(dense)
    torch.manual_seed(dense["seed"])
    w1 = workload.make_model().state_dict()
    torch.manual_seed(dense["seed"])
    w2 = workload.make_model().state_dict()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


# -- the report on a fixture directory -------------------------------------------------------
def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0.01  # not a blank canvas


def _fixture_summary(label, seed, acc, loss, ratio, kpercent, workers=2, **extra):
    summary = {
        "type": "summary",
        "run_id": f"{label} w{workers} s{seed}",
        "attempt": f"{label}{workers}{seed}",
        "cell_hash": "x",
        "survey": "fixture",
        "label": label,
        "compressor": "topk" if ratio < 1 else "none",
        "memory": "none",
        "communicator": "allgather" if ratio < 1 else "allreduce",
        "params": {"compress_ratio": ratio} if ratio < 1 else {},
        "tags": {"kpercent": kpercent},
        "workers": workers,
        "seed": seed,
        "network": "local",
        "workload": "mnist1d-mlp",
        "workload_description": "fixture",
        "parameters": 1000,
        "batch_size": 32,
        "global_batch": 64,
        "lr": 0.05,
        "lr_tuning": None,
        "momentum": 0.9,
        "epochs": 3,
        "steps_per_epoch": 10,
        "steps": 30,
        "final_test_accuracy": acc,
        "final_test_loss": loss,
        "final_train_accuracy": acc + 0.01,
        "final_train_loss": loss - 0.01,
        "best_test_accuracy": acc,
        "target_accuracy": 0.8,
        "epochs_to_target": 2 if acc >= 0.8 else None,
        "time_to_target_s": 4.0 if acc >= 0.8 else None,
        "train_time_s": 6.0,
        "samples_per_s": 320.0,
        "bytes_per_step": 4000 * ratio,
        "dense_bytes_per_step": 4000.0,
        "compression_ratio": ratio,
        "exchanges_per_step": 4,
        "compute_s": 0.004,
        "compress_s": 0.001,
        "communicate_s": 0.002,
        "decompress_s": 0.0005,
        "wait_s": 0.003,
        "step_s": 0.007,
        "peak_rss_mb": 300.0,
        "peak_gpu_mb": 0.0,
        "device": "cpu",
        "backend": "gloo",
        "torch": "x",
        "host": "h",
    }
    summary.update(extra)
    epochs = [
        {
            "type": "epoch",
            "run_id": summary["run_id"],
            "attempt": summary["attempt"],
            "epoch": e,
            "test_accuracy": acc * e / 3,
            "test_loss": loss * (4 - e),
        }
        for e in (1, 2, 3)
    ]
    return epochs + [summary]


def write_fixture(directory):
    records = []
    records += _fixture_summary("100 (send all)", 0, 0.90, 0.30, 1.0, 100)
    records += _fixture_summary("100 (send all)", 1, 0.92, 0.28, 1.0, 100)
    records += _fixture_summary("1", 0, 0.85, 0.40, 0.02, 1)
    records += _fixture_summary("1", 1, 0.87, 0.38, 0.02, 1)
    records += _fixture_summary("0 (send none)", 0, 0.10, 2.30, 0.004, 0)
    records.append(
        {
            "type": "tuning",
            "tuning_key": "k",
            "label": "1",
            "workers": 2,
            "network": "local",
            "candidates": [
                {"lr": 0.01, "heldout_accuracy": 0.5, "heldout_loss": 1.0},
                {"lr": 0.1, "heldout_accuracy": None, "heldout_loss": None},
            ],
            "chosen_lr": 0.01,
        }
    )
    records.append({"type": "error", "run_id": "broken w2 s0", "message": "Traceback...\nValueError: boom"})
    with open(os.path.join(directory, "results.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_report_on_fixture(tmp_path):
    write_fixture(tmp_path)
    path = report.write_report(str(tmp_path))
    text = open(path).read()
    # the general table: mean ± sample std over the two seeds
    assert "| 100 (send all) | 2 | local | 2 | 0.9100 ± 0.0141 | 0.2900 ± 0.0141 |" in text
    # the k-percent masking table, rows by decreasing k
    lines = text.splitlines()
    start = lines.index("| Send k% grads | Accuracy | Loss |")
    assert lines[start + 2].startswith("| 100 (send all) | 0.9100 ± 0.0141 |")
    assert lines[start + 3].startswith("| 1 | 0.8600 ± 0.0141 |")
    assert lines[start + 4] == "| 0 (send none) | 0.1000 | 2.3000 |"
    # the time-to-accuracy table (epochs as the headline shows them)
    assert "| Model | Epochs to 80% | Time to 80% | Test acc (after 3 epochs) |" in text
    assert "| 100 (send all) | 2.00 epochs | 4 s | 91.00% | 92.00% | 1 | 3.91 KB |" in text
    assert "| 0 (send none) | not reached | — | 10.00% |" in text
    assert "0.01: 0.5000, 0.1: diverged | 0.01 |" in text
    assert "`broken w2 s0`: ValueError: boom" in text
    for png in ("accuracy_loss.png", "accuracy_vs_ratio.png", "time_split.png"):
        assert_png(tmp_path / png)
    assert cli.report_main([str(tmp_path / "missing")]) == 2


def test_report_confidence_intervals_and_welch_tests(tmp_path):
    """The seed-statistics table against closed forms: with 2 seeds each, the t quantile of 1
    degree of freedom is tan(π·0.475), and Welch's test on equal variances has 2 degrees of
    freedom, whose CDF is 1/2 + t / (2·sqrt(2 + t²))."""
    import math

    write_fixture(tmp_path)
    text = open(report.write_report(str(tmp_path))).read()
    s = math.sqrt(0.0002)  # sample std of (0.85, 0.87) and of (0.90, 0.92)
    half = math.tan(math.pi * 0.475) * s / math.sqrt(2)
    t = (0.86 - 0.91) / math.sqrt(s**2 / 2 + s**2 / 2)
    p = 2 * (1 - (0.5 + abs(t) / (2 * math.sqrt(2 + t * t))))
    row = next(line for line in text.splitlines() if line.startswith("| 1 | 2 | local | 2 | 0.8600 |"))
    assert "too few seeds (2; an interval needs 3)" in row  # [0.86 ± half] from 1 degree of freedom
    assert report.confidence_interval([0.85, 0.87]) == pytest.approx((0.86, half))
    assert f"| 100 (send all) | -0.0500 | {t:.2f} | {p:.3g} | no significant difference |" in row
    assert "| 100 (send all) | 2 | local | 2 | 0.9100 |" in text and "(baseline)" in text
    assert "| 0 (send none) | 2 | local | 1 | 0.1000 | too few seeds (1; an interval needs 3) |" in text
    assert "not testable (needs ≥ 2 seeds each)" in text
    # a clear difference is called, with its direction
    assert report.welch_test([0.5, 0.51, 0.52], [0.9, 0.91, 0.92])[1] < 0.05
    assert report.welch_test([0.5], [0.9, 0.91]) is None


# -- the projection model --------------------------------------------------------------------
def test_cost_models_against_hand_computed_numbers():
    alpha, beta = 1e-4, 8 / 1e9  # 0.1 ms, 1 Gbit/s
    # ring allreduce, N=8, 100 MB: 2·7·α + 2·7/8·1e8·8e-9 = 0.0014 + 1.4 (allreduce's declared cost)
    assert project.communication_time("allreduce", 8, 1e8, 1, alpha, beta) == pytest.approx(1.4014)
    # allgather, N=8, 1 MB: sizes then data, 2·7·α + 7·1e6·8e-9 = 0.0014 + 0.056
    assert project.communication_time("allgather", 8, 1e6, 1, alpha, beta) == pytest.approx(0.0574)
    # broadcast in turn, N=8, 1 MB: the sizes' 7 steps and 8 trees of 3 hops, 31·α + 8·1e6·8e-9 = 0.0031 + 0.064
    assert project.communication_time("broadcast", 8, 1e6, 1, alpha, beta) == pytest.approx(0.0671)
    assert project.communication_time("allreduce", 1, 1e8, 1, alpha, beta) == 0.0
    assert project.communication_time("broadcast", 5, 0, 1, alpha, 0) == pytest.approx(
        (4 + 5 * 3) * alpha
    )  # ⌈log2 5⌉ = 3

    dense = {
        "label": "dense",
        "compressor": "none",
        "communicator": "allreduce",
        "workers": 2,
        "rounds": 1,
        "compute_s": 0.1,
        "compress_s": 0.0,
        "decompress_s": 0.0,
        "bytes_per_step": 1e8,
        "dense_bytes_per_step": 1e8,
        "exchanges_per_step": 1,
        "batch_size": 32,
    }
    sparse = dict(
        dense,
        label="dgc",
        compressor="dgc",
        communicator="allgather",
        compress_s=0.01,
        decompress_s=0.002,
        bytes_per_step=1e6,
    )
    rows = project.project([dense, sparse], [8], [1e9], latency_ms=0.1)
    by = {r["label"]: r for r in rows}
    # dense: 0.1 + 1.4014
    assert by["dense"]["step_s"] == pytest.approx(1.5014) and by["dense"]["speedup"] == pytest.approx(1.0)
    # dgc: 0.1 + 0.01 + 0.002·8/2 + (2·7·α + 7·1e6·β) = 0.1 + 0.01 + 0.008 + 0.0574 = 0.1754
    assert by["dgc"]["step_s"] == pytest.approx(0.1754)
    assert by["dgc"]["communication_s"] == pytest.approx(0.0574)
    assert by["dgc"]["speedup"] == pytest.approx(1.5014 / 0.1754)
    assert by["dgc"]["samples_per_s"] == pytest.approx(32 * 8 / 0.1754)
    with pytest.raises(GraceConfigError, match="no cost model"):
        project.communication_time("carrier-pigeon", 2, 1, 1, alpha, beta)
    # the latency counts the measured fusion groups when the survey recorded them (8 tensors
    # in 3 groups: 3 sets of collectives), else the tensors
    eight = dict(sparse, exchanges_per_step=8)
    fused = dict(eight, groups_per_step=3)
    assert project.project_step(eight, 8, alpha, beta)[1] == pytest.approx(8 * 2 * 7 * alpha + 7 * 1e6 * beta)
    assert project.project_step(fused, 8, alpha, beta)[1] == pytest.approx(3 * 2 * 7 * alpha + 7 * 1e6 * beta)
    # gTop-k: sparse_allreduce's 4 collectives + 4 histogram allreduces; K pairs back, not the union
    gtopk = project.modelled_name("sparse_allreduce", {"global_topk": True})
    assert (
        gtopk == "sparse_allreduce+global_topk" and project.modelled_name("sparse_allreduce", {}) == "sparse_allreduce"
    )
    assert project.communication_time(gtopk, 8, 1e6, 1, alpha, beta) == pytest.approx(
        (4 * 7 + 4 * 14) * alpha + 2 * 7 / 8 * 1e6 * beta
    )
    labels = [m["label"] for m in project.with_communicators([sparse], [gtopk, "reduce_scatter"])]
    assert labels == ["dgc", "dgc @ sparse_allreduce+global_topk"]  # reduce_scatter refuses dgc


def test_the_bandwidth_each_utilization_needs_is_solved_from_the_model():
    """c / T(β) = u solved for β: projecting at that bandwidth gives u back; a method whose
    latency and compression alone exceed (1/u − 1)·c never gets there; one node needs none."""
    method = {
        "label": "topk",
        "compressor": "topk",
        "communicator": "allgather",
        "workers": 2,
        "rounds": 1,
        "compute_s": 0.1,
        "compress_s": 0.0005,
        "decompress_s": 0.0002,
        "bytes_per_step": 1e6,
        "dense_bytes_per_step": 1e8,
        "exchanges_per_step": 4,
        "batch_size": 32,
    }
    for target in (0.9, 0.95):
        for latency_ms in (0.01, 0.001):
            needed = project.bandwidth_for_utilization(method, 8, latency_ms, target)
            # by hand: T(β) = c + s + d·8/2 + 4·2·7·α + 7·1e6·β
            base = 0.1 + 0.0005 + 0.0002 * 4 + 4 * 14 * latency_ms / 1000
            assert needed == pytest.approx(8 * 7e6 / (0.1 / target - base))
            (row,) = project.project([method], [8], [needed], latency_ms)
            assert row["utilization"] == pytest.approx(target)
    slow = dict(method, compress_s=0.02)  # 0.1/0.9 − 0.1 = 0.011 < 0.02: no bandwidth helps
    assert math.isinf(project.bandwidth_for_utilization(slow, 8, 0.1, 0.9))
    assert project.bandwidth_for_utilization(method, 1, 0.1, 0.9) == 0.0  # one node sends nothing
    rows = project.utilization_rows([method, slow], [1, 8], [0.5, 250.0])
    assert len(rows) == 2 * 2 * 2 and "never" in project.format_utilization(rows)


def test_project_sweeps_round_trips_and_low_bandwidth(tmp_path, capsys):
    write_fixture(tmp_path)
    assert cli.project_main([str(tmp_path), "--nodes", "8", "--low-bandwidth"]) == 0
    printed = capsys.readouterr().out
    for rate, rtt in (("100mbit", 250), ("1gbit", 25), ("10gbit", 0.5)):  # α = RTT/2
        assert f"| 8 | {rate} | {rtt:g} ms |" in printed
    assert "Bandwidth for 90 % utilization" in printed and "Bandwidth for 95 % utilization" in printed
    with open(tmp_path / "projection.csv") as f:
        assert len(list(csv.DictReader(f))) == 3 * 3 * 3  # methods × bandwidths × latencies
    assert cli.project_main([str(tmp_path), "--nodes", "8", "--rtt", "1,500", "--bandwidth", "1gbit"]) == 0
    assert "| 500 ms |" not in capsys.readouterr().out  # 500 ms round trip is α = 250 ms
    assert_png(tmp_path / "projection.png")


def test_project_command_on_fixture(tmp_path, capsys):
    write_fixture(tmp_path)
    assert cli.project_main([str(tmp_path), "--nodes", "2,8", "--bandwidth", "1gbit,10gbit", "--latency", "0.05"]) == 0
    printed = capsys.readouterr().out
    assert "| 100 (send all) | 8 | 1gbit | 0.05 ms |" in printed
    with open(tmp_path / "projection.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 2 * 2
    # the dense baseline (none/allreduce) projects to itself
    assert all(math.isclose(float(r["speedup"]), 1.0) for r in rows if r["label"] == "100 (send all)")
    assert_png(tmp_path / "projection.png")
    assert cli.project_main([str(tmp_path), "--nodes", "x"]) == 2
    assert cli.project_main([str(tmp_path), "--bandwidth", "1gbps"]) == 2


def test_cli_wiring(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="grace-dgc")
    cli.add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["survey", "--preset", "quick", "--out", "x", "--workers", "1,2", "--bandwidth", "1gbit"])
    assert args.func is cli.run_survey and args.workers == "1,2" and args.bandwidth == "1gbit"
    assert parser.parse_args(["report", "d"]).dir == "d"
    assert parser.parse_args(["project", "d", "--nodes", "4"]).nodes == "4"
    bad = tmp_path / "bad.toml"
    bad.write_text("workload = 'digits-mlp'\n[[methods]]\ncompressor = 'nope'\n")
    assert cli.survey_main(["--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "unknown compressor 'nope'" in capsys.readouterr().err


def test_presets_are_named_by_what_they_reproduce_and_old_names_still_load():
    for old, new in cfg.PRESET_ALIASES.items():
        assert new in cfg.PRESETS
        a, b = cfg.load_preset(old).cells(), cfg.load_preset(new).cells()
        assert [c.cell_hash for c in a] == [c.cell_hash for c in b]
        assert cfg.load_preset(old).name == new
    with pytest.raises(GraceConfigError, match="earlier names seed000-kpercent"):
        cfg.load_preset("seed002")


def test_cells_are_dataclasses_and_rank_totals_name_every_metric():
    from grace_survey.config.cell import Cell
    from grace_survey.running.metrics import RankTotals, epoch_record

    cell = cfg.SurveyConfig(TINY).cells()[0]
    assert isinstance(cell, Cell) and cell["workers"] == cell.workers == 2
    assert cell.cell_hash == cfg.cell_hash(cell.as_dict()) and cell.tuning_key == cfg.tuning_key(cell.as_dict())
    totals = RankTotals(
        loss=6.0,
        hits=3,
        count=4,
        bytes_sent=100,
        dense_bytes=400,
        exchanges=8,
        timed_steps=1,
        train_time=2.0,
        compute=0.5,
        wait=0.25,
    )
    other = RankTotals.from_list(totals.as_list())
    other.train_time, other.bytes_sent = 3.0, 300
    record = epoch_record([totals, other], 1, 0.1, 2, 64, 10.0, 0.5, 0.75, {})
    assert record["train_loss"] == 12 / 8 and record["epoch_time_s"] == 3.0 and record["elapsed_s"] == 13.0
    assert record["bytes_per_step"] == 400 / 2 / 2 and record["compression_ratio"] == 400 / 800
    assert record["compute_s"] == 0.5 and record["step_s"] == 0.75 and record["exchanges_per_step"] == 4


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    raw = dict(TINY, workers=1, tensorboard=True, methods=[TINY["methods"][0]])
    summaries, failures = runner.run_grid(cfg.SurveyConfig(raw), out, progress=False, log=lambda *a: None)
    assert failures == []
    runs = os.listdir(os.path.join(out, "tensorboard"))
    assert runs == ["dense_w1_s0"]
    events = EventAccumulator(os.path.join(out, "tensorboard", runs[0]))
    events.Reload()
    assert len(events.Scalars("train/loss")) == summaries[0]["steps"]
    assert events.Scalars("epoch/test_accuracy")[-1].value == pytest.approx(summaries[0]["final_test_accuracy"])
    with pytest.raises(GraceConfigError, match="tensorboard = 1 must be a bool"):
        cfg.SurveyConfig(dict(TINY, tensorboard=1))


def _child_peaks():
    import torch

    from grace_survey.running.train import peak_rss_mb, reset_peak_rss

    before = peak_rss_mb()
    block = torch.ones(300 * 2**20 // 4)  # 300 MB touched
    high = peak_rss_mb()
    del block
    reset_peak_rss()
    return before, high, peak_rss_mb()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM is Linux's")
def test_each_rank_measures_its_own_peak_memory():
    """Issue 21: ranks started by spawn inherited the launcher's ru_maxrss across exec, so every
    run reported the same peak. A child of a parent that touched 600 MB reports its own peak,
    sees its own 300 MB block, and a reset forgets it."""
    import multiprocessing

    import torch

    parent_block = torch.ones(600 * 2**20 // 4)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        before, high, after_reset = pool.apply(_child_peaks)
    del parent_block
    assert before < 500, before  # not the parent's ≥ 600 MB
    assert high >= before + 250, (before, high)
    assert after_reset < high - 250, (high, after_reset)
