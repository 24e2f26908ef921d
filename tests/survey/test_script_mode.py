"""Script mode: the survey runs a user's own torchrun-style script once per cell on 2 gloo ranks.
What it measures (exact bytes, steps, time to target from the reported metrics), the report
and the projection on its results, the example script end to end, the torchrun launcher, and
the failures: a crash on one rank, a script that never asks for its method, a metric that is
not a number, a script that hangs — each ends the cell with a clear error, never a hang."""

import json
import math
import os
import re
import sys
import textwrap
import time

import pytest

from grace_dgc.errors import GraceConfigError
from grace_survey import cell_grace, cell_seed, cli, report, report_metrics
from grace_survey.config import settings as cfg
from grace_survey.projection import project
from grace_survey.running import runner
from grace_survey.running.results import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a linear model 8 -> 2 (18 parameters), 5 steps per epoch, 2 epochs; MODE picks a failure
SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed as dist, torch.nn.functional as F
    import grace_dgc
    import grace_survey as survey

    MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if MODE == "abort-at-exit":  # after grace's own exit handler (atexit runs them last in, first out)
        import atexit, os, signal
        # rank 1 only, a second after rank 0's exit: torchrun then stops no rank mid-exit
        atexit.register(lambda: os.environ["RANK"] == "1" and (time.sleep(1), os.kill(os.getpid(), signal.SIGABRT)))
    if MODE == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank = hvd.rank()
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(survey.cell_seed())
    net = torch.nn.Linear(8, 2)
    if MODE == "no-method":
        sys.exit(0)
    grace = survey.cell_grace()
    opt = grace_dgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), grace, net.named_parameters())
    g = torch.Generator().manual_seed(rank)
    for epoch in range(2):
        for step in range(5):
            x = torch.randn(4, 8, generator=g)
            opt.zero_grad()
            F.cross_entropy(net(x), (x[:, 0] > 0).long()).backward()
            opt.step()
        if MODE == "crash" and rank == 1:
            raise ZeroDivisionError("rank 1 divides by zero")
        if MODE == "abort" and rank == 1:
            import os, signal
            os.kill(os.getpid(), signal.SIGABRT)
        if MODE == "hang":
            time.sleep(120)
        accuracy = "high" if MODE == "bad-metric" else torch.tensor(0.5 + 0.2 * epoch)
        survey.report_metrics(epoch=epoch + 1, accuracy=accuracy, loss=1.0 - 0.1 * epoch, samples=20, custom=3)
    if MODE != "horovod":
        dist.destroy_process_group()
    """
)
METHODS = [
    {"label": "dense", "compressor": "none"},
    {"label": "topk", "compressor": "topk", "memory": "residual", "communicator": "allgather",
     "params": {"compress_ratio": 0.125}},
]  # fmt: skip


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _run(script, out, args=(), methods=METHODS[:1], **extra):
    raw = {"workers": 2, "seeds": [0], "methods": methods, "target_accuracy": 0.6, "timeout": 60, **extra}
    conf = cfg.SurveyConfig(cfg.script_mode(raw, script) | {"script_args": list(args)})
    return runner.run_grid(conf, str(out), progress=False, log=lambda *a: None)


def test_a_script_runs_per_cell_and_its_measurements_are_exact(script, tmp_path):
    out = tmp_path / "out"
    summaries, failures = _run(script, out, methods=METHODS, tensorboard=True)
    assert not failures, failures
    dense, topk = summaries
    # 18 fp32 gradients per step, every step exchanged; 5 steps an epoch
    assert dense["dense_bytes_per_step"] == dense["bytes_per_step"] == 4 * 18
    assert dense["steps"] == 10 and dense["steps_per_epoch"] == 5 and dense["epochs"] == 2
    # top-k over allgather: per tensor two int64 size headers, k fp32 values and k int32 indices
    assert topk["bytes_per_step"] == (16 + 2 * 8) + (16 + 1 * 8)  # weight (16, k = 2), bias (2, k = 1)
    assert topk["compression_ratio"] == 56 / 72 and topk["workload"] == "script:train.py"
    epochs = [r for r in read_records(str(out)) if r["type"] == "epoch" and r["label"] == "dense"]
    assert [e["test_accuracy"] for e in epochs] == pytest.approx([0.5, 0.7])
    assert [e["test_loss"] for e in epochs] == pytest.approx([1.0, 0.9]) and epochs[0]["metrics"] == {"custom": 3.0}
    # the target (0.6) is reached at the second report; its time is the elapsed time then
    assert dense["epochs_to_target"] == 2 and dense["time_to_target_s"] == epochs[1]["elapsed_s"]
    assert dense["samples_per_s"] == pytest.approx(2 * 2 * 20 / dense["train_time_s"])  # 2 ranks × 20 per report
    for key in ("step_s", "compute_s", "wait_s", "compress_s", "communicate_s"):
        assert dense[key] >= 0
    assert dense["step_s"] == pytest.approx(dense["compute_s"] + dense["wait_s"])
    assert dense["script_sha"] and dense["cell_hash"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard" / "dense_w2_s0")).Reload()
    assert [e.value for e in events.Scalars("epoch/custom")] == [3.0, 3.0]
    assert [e.step for e in events.Scalars("epoch/test_accuracy")] == [5, 10]
    # the report and the projection read script results as any other
    text = open(report.write_report(str(out))).read()
    assert "dense" in text and "topk" in text
    assert project.main([str(out), "--nodes", "8", "--bandwidth", "1gbit"]) == 0
    # a rerun skips the finished cells; an edited script is a different run
    again, _ = _run(script, out, methods=METHODS)
    assert again == []
    with open(script, "a") as f:
        f.write("\n# edited\n")
    assert len(_run(script, out, methods=METHODS[:1])[0]) == 1


def test_a_crash_on_one_rank_ends_the_cell_with_its_traceback(script, tmp_path):
    start = time.monotonic()
    summaries, failures = _run(script, tmp_path / "out", args=["crash"])
    assert time.monotonic() - start < 45  # rank 0, blocked in a collective, was stopped: no hang
    assert summaries == [] and len(failures) == 1
    message = failures[0][1]
    assert "rank 1 of the script failed first" in message
    assert "ZeroDivisionError: rank 1 divides by zero" in message and "Traceback" in message
    errors = [r for r in read_records(str(tmp_path / "out")) if r["type"] == "error"]
    assert "ZeroDivisionError" in errors[0]["message"]


def test_a_signal_after_the_script_ended_keeps_the_cell_and_one_during_it_does_not(script, tmp_path, capfd):
    """torch's gloo teardown sometimes aborts a rank ("terminate called without an active
    exception") after the script has ended: its reports are whole, so the cell stands, with a
    line saying so; a rank killed by a signal while the script runs still fails the cell."""
    summaries, failures = _run(script, tmp_path / "out", args=["abort-at-exit"])
    assert failures == [] and len(summaries) == 1
    assert "exited with status -6 after its script had finished" in capfd.readouterr().err
    summaries, failures = _run(script, tmp_path / "again", args=["abort"])
    assert summaries == [] and len(failures) == 1
    assert "rank 1 of the script failed first (exit status -6)" in failures[0][1]


@pytest.mark.parametrize(
    "mode, message",
    [
        ("no-method", "finished without asking for its method: call grace_survey.cell_grace()"),
        ("bad-metric", r"report_metrics\(accuracy=...\) got str 'high'; a metric is a number"),
    ],
)
def test_scripts_that_misuse_the_api_get_a_clear_error(script, tmp_path, mode, message):
    summaries, failures = _run(script, tmp_path / "out", args=[mode])
    assert summaries == [] and len(failures) == 1
    assert re.search(message, failures[0][1]), failures[0][1]


def test_a_hanging_script_is_stopped_at_the_timeout(script, tmp_path):
    start = time.monotonic()
    _, failures = _run(script, tmp_path / "out", args=["hang"], timeout=8)
    assert time.monotonic() - start < 40
    assert "did not finish within timeout = 8 s" in failures[0][1]


def test_run_alone_the_script_api_falls_back(monkeypatch):
    monkeypatch.delenv("GRACE_DGC_CELL", raising=False)
    grace = cell_grace("topk", "residual", "allgather", compress_ratio=0.5, engine="local")
    assert (grace.compressor.registered_name, grace.memory.registered_name) == ("topk", "residual")
    assert cell_seed(7) == 7
    report_metrics(epoch=1, accuracy=0.5)  # a no-op: nothing to write to


def test_report_metrics_advances_the_epoch_and_records_the_rank(tmp_path, monkeypatch):
    """In-process, one rank: DGC's warm-up follows the epochs the script reports."""
    from grace_survey.script import api as script_mode

    conf = cfg.SurveyConfig(
        {"script": __file__, "workers": 1, "methods": [{"compressor": "dgc", "memory": "momentum",
         "communicator": "allgather", "params": {"compress_ratio": 0.001, "warmup_epochs": 2}}]}
    )  # fmt: skip
    cell = conf.cells()[0]
    monkeypatch.setenv(script_mode.CELL_ENV, json.dumps(cell.as_dict()))
    monkeypatch.setenv(script_mode.DIR_ENV, str(tmp_path))
    grace = cell_grace(engine="local")
    assert grace.compressor.current_ratio == pytest.approx(0.001**0.5)  # epoch 0 of the warm-up
    report_metrics(epoch=1, accuracy=0.5)
    assert grace.compressor.epoch == 1 and grace.compressor.current_ratio == pytest.approx(0.001)
    (line,) = [json.loads(x) for x in open(tmp_path / "rank0.jsonl")]
    assert line["engine"] == "local" and line["timed_by_script"] is False and line["metrics"] == {"test_accuracy": 0.5}
    assert os.path.exists(tmp_path / "started0")
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test


def test_a_relative_out_and_a_script_elsewhere(script, tmp_path, monkeypatch):
    """The ranks run in the user's folder and write their reports to --out as given (relative)."""
    monkeypatch.chdir(tmp_path)
    summaries, failures = _run(script, "out-relative")
    assert not failures, failures
    assert os.path.isdir(tmp_path / "out-relative" / "script-runs") and summaries[0]["epochs"] == 2


@pytest.mark.launches
def test_the_torchrun_launcher_runs_a_cell(script, tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed beside this python")
    summaries, failures = _run(
        script, tmp_path / "out", launcher=f"{torchrun} --nproc-per-node {{workers}} --master-port {{port}}"
    )
    assert not failures, failures
    assert summaries[0]["dense_bytes_per_step"] == 72 and summaries[0]["epochs_to_target"] == 2


@pytest.mark.launches
def test_under_torchrun_a_signal_after_the_script_ended_keeps_the_cell_and_one_during_it_does_not(
    script, tmp_path, capfd
):
    """torchrun turns a rank's signal into its own exit status 1: the cell stands when every
    rank had finished its script, and fails, naming the launcher, when one had not."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed beside this python")
    launcher = f"{torchrun} --nproc-per-node {{workers}} --master-port {{port}}"
    summaries, failures = _run(script, tmp_path / "out", args=["abort-at-exit"], launcher=launcher)
    assert failures == [] and len(summaries) == 1
    assert "launcher exited with status 1 after its script had finished" in capfd.readouterr().err
    summaries, failures = _run(script, tmp_path / "again", args=["abort"], launcher=launcher)
    assert summaries == [] and len(failures) == 1
    assert "launcher of the script failed first (exit status 1)" in failures[0][1]


@pytest.mark.launches
def test_the_horovodrun_launcher_runs_a_horovod_script(script, tmp_path):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        pytest.skip("Horovod is not installed (make horovod)")
    summaries, failures = _run(
        script,
        tmp_path / "out",
        args=["horovod"],
        launcher=f"{horovodrun} -np {{workers}} -H localhost:{{workers}} --gloo",
    )
    assert not failures, failures
    assert summaries[0]["engine"] == "horovod" and summaries[0]["dense_bytes_per_step"] == 72
    assert summaries[0]["epochs_to_target"] == 2


def test_config_errors_of_script_mode(script, tmp_path):
    with pytest.raises(GraceConfigError, match="epochs belong to the training loop.*--script-args"):
        cfg.SurveyConfig({"script": script, "epochs": 3, "methods": METHODS})
    with pytest.raises(GraceConfigError, match=r"methods\[0\] sets schedule, which script mode cannot apply"):
        cfg.SurveyConfig({"script": script, "methods": [dict(METHODS[0], schedule={"name": "diloco"})]})
    # a preset's or a workload config's training settings are dropped, not errors
    assert cfg.SurveyConfig(cfg.script_mode(cfg.preset_dict("quick"), script)).script == script
    with pytest.raises(GraceConfigError, match="not a file"):
        cfg.SurveyConfig({"script": str(tmp_path / "nope.py"), "methods": METHODS})
    with pytest.raises(GraceConfigError, match="give workload or script, not both"):
        cfg.SurveyConfig({"script": script, "workload": "digits-mlp", "methods": METHODS})
    with pytest.raises(GraceConfigError, match="'no-such-launcher' is not on PATH"):
        cfg.SurveyConfig({"script": script, "launcher": "no-such-launcher -n {workers}", "methods": METHODS})
    with pytest.raises(GraceConfigError, match="belong to script mode"):
        cfg.SurveyConfig({"workload": "digits-mlp", "launcher": "local", "methods": METHODS})


def test_the_example_classifier_through_the_command_line(tmp_path, capsys):
    """examples/survey_classifier.py, as the README runs it, then report and projection."""
    conf = tmp_path / "methods.toml"
    conf.write_text(
        'workers = 2\nseeds = [0]\ntarget_accuracy = 0.5\n[[methods]]\nlabel = "dense"\ncompressor = "none"\n'
        '[[methods]]\nlabel = "powersgd"\ncompressor = "powersgd"\nmemory = "powersgd"\nparams = {compress_rank = 2}\n'
    )
    out = str(tmp_path / "out")
    example = os.path.join(ROOT, "examples", "survey_classifier.py")
    code = cli.main(["survey", "--script", example, "--config", str(conf), "--out", out, "--no-progress",
                     "--script-args", "--epochs", "2"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    summaries = [r for r in read_records(out) if r["type"] == "summary"]
    assert [s["label"] for s in summaries] == ["dense", "powersgd"]
    params = sum(p.numel() for p in _example_model().parameters())
    assert params == 16 * 9 + 16 + 32 * 16 * 9 + 32 + 512 * 10 + 10
    assert summaries[0]["dense_bytes_per_step"] == 4 * params and summaries[0]["final_test_accuracy"] > 0.5
    assert summaries[1]["compression_ratio"] < 0.5 and summaries[0]["timing"] == "the script's train_time_s"
    assert os.path.isfile(os.path.join(out, "report.md"))
    assert cli.main(["project", out, "--nodes", "8"]) == 0
    with open(os.path.join(out, "survey_config.json")) as f:
        assert json.load(f)["script"] == example


def test_the_example_transformer_reports_perplexity_as_its_own_metric(tmp_path, capsys):
    """examples/survey_transformer.py (AdamW, clipping on the averaged gradient) on a slice of the text."""
    from grace_survey.workloads.text import corpus_text, transformer_parameter_count, vocabulary

    conf = tmp_path / "methods.toml"
    conf.write_text('workers = 2\nseeds = [0]\n[[methods]]\nlabel = "topk"\ncompressor = "topk"\nmemory = "residual"\n'
                    'communicator = "allgather"\nparams = {compress_ratio = 0.01}\n')  # fmt: skip
    out = str(tmp_path / "out")
    example = os.path.join(ROOT, "examples", "survey_transformer.py")
    code = cli.main(["survey", "--script", example, "--config", str(conf), "--out", out, "--no-progress",
                     "--script-args", "--epochs", "1", "--train-chars", "20000", "--context", "32"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    (summary,) = [r for r in read_records(out) if r["type"] == "summary"]
    vocab = len(vocabulary(corpus_text()))
    assert summary["parameters"] == transformer_parameter_count(vocab, 32, 128, 4)
    assert summary["metrics"]["perplexity"] == pytest.approx(math.exp(summary["final_test_loss"]))
    assert 0 < summary["final_test_accuracy"] < 1 and summary["compression_ratio"] < 0.05


def _example_model():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import survey_classifier
    finally:
        sys.path.pop(0)
    return survey_classifier.model()
