"""A survey as a newcomer meets it (issue 56, points 5, 6 and 9): Ctrl-C stops the ranks and
ends in one line with exit status 130; a rerun into the same --out says which runs it reuses
and which it runs again and why; the projection's files an earlier configuration left are
removed and the report leaves out runs that are not of the current grid; --seeds on the
command line; no progress bars where stderr is not a terminal; the registry listing wrapped;
the report's figures formatted and its plots labelled; the demo says what it does as it goes."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from test_report_headline import run_records
from test_survey import TINY, write_fixture

from grace_dgc.cli import main, registry_table
from grace_dgc.errors import GraceConfigError
from grace_survey import cli, report
from grace_survey.config import settings as cfg
from grace_survey.report import plots
from grace_survey.report.grouping import gather
from grace_survey.running.grid import prepare
from grace_survey.running.rerun import earlier_cells, plan_lines
from grace_survey.running.results import read_records

#: one method on one rank, two steps an epoch: a run takes a fraction of a second
DENSE = {**TINY, "workers": 1, "max_steps": 2, "methods": [TINY["methods"][0]]}
SEEDS = 6

TOML = f"""
name = "ux"
workload = "digits-mlp"
workers = 1
epochs = 1
max_steps = 2
seeds = {list(range(SEEDS))}
workload_options = {{ train_samples = 512, test_samples = 200 }}

[[methods]]
label = "dense"
compressor = "none"
"""


def _kept(out):
    return [r for r in read_records(out) if r.get("type") == "summary"]


def _running_in_group(pgid):
    """The processes of group ``pgid`` still running (a zombie has ended: it waits for a reaper)."""
    running = []
    for pid in (entry for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _parent, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != "Z":
            running.append(int(pid))
    return running


def _group_gone(pgid, seconds=10.0):
    """Whether every process of group ``pgid`` has ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while _running_in_group(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.launches  # a survey as a user starts it, and a Ctrl-C to its whole process group
def test_ctrl_c_ends_in_one_line_and_exit_130_and_the_same_command_finishes(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRACE_DGC_DEBUG", raising=False)
    config, out = tmp_path / "ux.toml", str(tmp_path / "out")
    config.write_text(TOML)
    argv = ["survey", "--config", str(config), "--out", out, "--no-report"]
    # its own session, as a terminal's foreground job: the signal goes to every process in it
    proc = subprocess.Popen(
        [sys.executable, "-m", "grace_dgc.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not _kept(out):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no run finished in 180 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    kept = len(_kept(out))
    assert proc.returncode == 130, stderr
    assert 1 <= kept < SEEDS, (kept, stdout)
    command = shlex.join(["grace-dgc", *argv])
    assert stderr == (
        f"interrupted: {kept} of {SEEDS} runs kept, {SEEDS - kept} left; run the same command to finish: {command}\n"
    )  # one line: no traceback, no rank's KeyboardInterrupt, no leaked-semaphore warning, no progress bar
    if os.path.isdir("/proc"):
        assert _group_gone(proc.pid), f"a rank outlived the survey: {_running_in_group(proc.pid)}"
    lines = stdout.splitlines()  # a line per run where stderr is not a terminal
    assert len(lines) <= kept, stdout
    for i, line in enumerate(lines):
        assert line.startswith(f"[survey] {i + 1}/{SEEDS} dense w1 s{i}: test acc"), stdout

    # the same command: the kept runs are reused, the others run; the projection made before goes
    for name in ("projection.md", "projection.csv"):
        (tmp_path / "out" / name).write_text("made from the runs before")
    assert cli.survey_main(argv[1:]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[:2] == [
        f"[survey] {kept} run{'s' if kept > 1 else ''} already in {out} with these settings: reused",
        f"[survey] {SEEDS - kept} run{'s' if SEEDS - kept > 1 else ''} not in {out} yet: run",
    ]
    assert len(_kept(out)) == SEEDS
    assert said[-1].startswith(
        "[survey] removed projection.md, projection.csv: made from the results before these runs"
    )
    assert not os.path.exists(tmp_path / "out" / "projection.md")


def _earlier(tmp_path, raw):
    """The folder a survey of ``raw`` left (its config and grid, as prepare writes them) and its
    runs as finished: (folder, run_id → cell_hash)."""
    out = str(tmp_path / "out")
    cells, _ = prepare(cfg.SurveyConfig(raw), out, check_workload=False)
    return out, {cell.run_id: cell.cell_hash for cell in cells}


def test_a_rerun_says_what_it_reuses_and_what_it_runs_again_and_why(tmp_path):
    old = {**DENSE, "epochs": 3, "seeds": [0, 1, 2]}
    out, done = _earlier(tmp_path, old)
    earlier = earlier_cells(out)
    assert set(earlier) == set(done)

    def lines(**change):
        return plan_lines(cfg.SurveyConfig({**old, **change}).cells(), done, earlier, records, out)

    records = []
    assert lines() == [f"[survey] 3 runs already in {out} with these settings: reused"]
    assert lines(epochs=5) == ["[survey] epochs changed 3 → 5: 3 runs re-run"]
    assert lines(epochs=5, max_steps=4, lr=0.2) == [
        "[survey] epochs changed 3 → 5, max_steps changed 2 → 4, lr changed default → 0.2: 3 runs re-run"
    ]
    records = [{"type": "error", "run_id": "dense w1 s3", "message": "boom"}]
    assert lines(seeds=[0, 1, 2, 3, 4]) == [
        f"[survey] 3 runs already in {out} with these settings: reused",
        "[survey] 1 run that failed before: run again",
        f"[survey] 1 run not in {out} yet: run",
    ]
    assert lines(seeds=[0]) == [
        f"[survey] 1 run already in {out} with these settings: reused",
        f"[survey] 2 runs in {out} not in this grid (another config's methods, workers or seeds): kept in "
        "results.jsonl, left out of the report",
    ]
    # where the earlier config no longer says what the runs were made with, the line says less
    assert plan_lines(cfg.SurveyConfig({**old, "epochs": 5}).cells(), done, {}, [], out) == [
        "[survey] its settings changed since it ran: 3 runs re-run"
    ]
    assert plan_lines(cfg.SurveyConfig(old).cells(), {}, {}, [], str(tmp_path / "new")) == []  # a new folder


def test_the_report_keeps_the_runs_of_the_current_grid_and_names_the_others(tmp_path):
    write_fixture(tmp_path)  # runs of "100 (send all)", "1" and "0 (send none)", cell_hash "x"
    grid = {"100 (send all) w2 s0": "x", "100 (send all) w2 s1": "x", "1 w2 s0": "x", "1 w2 s1": "y"}
    (tmp_path / "survey_grid.json").write_text(json.dumps({"runs": grid}))
    text = open(report.write_report(str(tmp_path))).read()
    section = text.split("## Runs left out\n\n")[1].split("\n\n")[0]
    assert section.startswith("2 run(s) in results.jsonl were made with settings other than")
    assert "`1 w2 s1`, `0 (send none) w2 s0`" in section  # made with other settings; not in the grid
    assert "| 1 | 2 | local | 1 | 0.8500 |" in text and "| 0 (send none) |" not in text
    assert "`broken w2 s0`" not in text  # its error is of another grid too
    (tmp_path / "survey_grid.json").write_text(json.dumps({"runs": {"1 w2 s1": "z"}}))
    with pytest.raises(GraceConfigError, match="no run in .* was made with the settings its last survey asked for"):
        report.write_report(str(tmp_path))


def test_seeds_on_the_command_line(tmp_path, capsys):
    config = tmp_path / "ux.toml"
    config.write_text(TOML.replace(f"seeds = {list(range(SEEDS))}", "repeats = 3"))
    parser = cli.add_survey_args(cli.OneLineParser(prog="grace-dgc survey"))
    args = parser.parse_args(["--config", str(config), "--out", str(tmp_path / "o"), "--seeds", "0-2,7"])
    assert cli._checked_config(args).seeds == [0, 1, 2, 7]  # replaces the config's repeats
    args = parser.parse_args(["--config", str(config), "--out", str(tmp_path / "o"), "--seeds", "5"])
    assert cli._checked_config(args).seeds == [5]
    for bad in ("1,1", "a", "-1", "3-1"):
        with pytest.raises(SystemExit) as stop:
            main(["survey", "--config", str(config), "--out", str(tmp_path / "o"), "--seeds", bad])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--seeds" in err and "0,1,2 or a range 0-4" in err, err
    assert not os.path.exists(tmp_path / "o")


def test_the_registry_listing_fits_the_width(capsys):
    main(["list"])  # stdout is not a terminal here: 100 columns
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    for width in (60, 100):
        lines = registry_table(width=width).splitlines()
        assert max(len(line) for line in lines) <= width
        for name in ("topk", "residual", "allgather", "compress_ratio=0.01"):
            assert name in registry_table(width=width)
        assert lines[0] == "compressors: what goes on the wire"
    wide = registry_table(width=10_000).splitlines()  # where the table fits: a row a line
    assert wide[0].split() == [
        "kind",
        "name",
        "aliases",
        "parameters",
        "(defaults)",
        "communicators",
        "what",
        "it",
        "is",
    ]
    assert any(line.split()[:2] == ["compressor", "topk"] for line in wide)


def _captured(monkeypatch):
    """The figures the report's plots draw, kept open instead of closed after saving."""
    figures = []

    def keep(plt, fig, path, laid_out=False):
        figures.append(fig)
        fig.canvas.draw()
        return path

    monkeypatch.setattr(plots, "save", keep)
    return figures


def test_accuracy_bars_are_the_tables_95_percent_intervals_and_say_so(tmp_path, monkeypatch):
    accuracies = [0.60, 0.64, 0.70]
    records = [r for seed, acc in enumerate(accuracies) for r in run_records("dense", seed, final=acc)]
    groups, _, _ = gather(records)
    figures = _captured(monkeypatch)
    plots.plot_accuracy_vs_ratio(groups, str(tmp_path / "a.png"))
    (fig,) = figures
    ax = fig.axes[0]
    (container,) = ax.containers
    (segment,) = container.lines[2][0].get_segments()
    low, high = sorted(y for _, y in segment)
    mean, half = report.confidence_interval(accuracies)
    assert low == pytest.approx(mean - half) and high == pytest.approx(mean + half)
    text = " ".join(t.get_text() for t in fig.texts)
    assert "95% confidence interval" in text and "statistics table" in text
    ratios = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert "1" in ratios and all(float(r) > 0 for r in ratios), ratios  # plain numbers, not 10⁰
    # fewer seeds than an interval needs: no bar
    figures.clear()
    plots.plot_accuracy_vs_ratio(gather(records[: len(records) * 2 // 3])[0], str(tmp_path / "b.png"))
    assert figures[0].axes[0].containers[0].lines[2] == ()


def test_a_loss_axis_within_a_decade_reads_in_plain_numbers(tmp_path, monkeypatch):
    records = [r for seed in (0, 1) for r in run_records("dense", seed)]  # losses 1.0 … 1.9
    figures = _captured(monkeypatch)
    plots.plot_curves(gather(records)[0], str(tmp_path / "c.png"))
    ax_loss = figures[0].axes[1]
    assert ax_loss.get_yscale() == "log"
    labels = [t.get_text() for t in ax_loss.get_yticklabels(minor=False) + ax_loss.get_yticklabels(minor=True)]
    shown = [label for label in labels if label]
    assert shown and all(float(label) > 0 for label in shown), labels  # 1, 1.2, … : no 1.2×10⁰ ($\\times$)
    epochs = [t.get_text() for t in figures[0].axes[0].get_xticklabels() if t.get_text()]
    assert epochs == [str(e) for e in range(1, 11)]


def test_mean_epochs_read_as_in_the_headline():
    records = []
    for seed, epochs in enumerate((14, 14, 15)):
        records += run_records("dense", seed, time=30.0 + seed, epochs=epochs)
    groups, _, _ = gather(records)
    assert "| 14.33 |" in report.headline_table(groups)
    assert "| 14.33 epochs |" in report.target_table(groups)


def test_the_report_explains_its_founding_tables(tmp_path):
    write_fixture(tmp_path)
    text = open(report.write_report(str(tmp_path))).read()
    assert "seed001" not in text and "seed000" not in text
    assert "preset `dgc-resnet20-time-to-accuracy`" in text and "preset `kpercent-masking`" in text


def test_the_demo_says_what_it_does_as_it_goes(capsys):
    from grace_dgc.demo import run_demo

    run_demo([["none", "none"], ["topk", "residual"]], workers=1, steps=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 method(s), 2 steps each, on 1 gloo rank(s) on this machine")
    assert lines[1].split() == ["method", "final", "loss", "bytes/step", "ratio", "seconds"]
    for line, name, ratio in zip(lines[2:], ("none+none", "topk+residual"), (1.0, None)):
        cells = line.split()
        assert cells[0] == name and len(cells) == 5 and float(cells[4]) >= 0
        assert ratio is None or float(cells[3]) == ratio


def test_the_interrupted_line_names_the_command_as_typed(monkeypatch):
    from grace_survey.running.grid import SurveyInterrupted

    args = cli.add_survey_args(cli.OneLineParser()).parse_args(["--preset", "quick", "--out", "runs/q"])
    monkeypatch.setattr(sys, "argv", ["/venv/bin/grace-dgc", "survey", "--preset", "quick", "--out", "runs/my q"])
    assert cli._interrupted_line(SurveyInterrupted(5, 9), args) == (
        "interrupted: 5 of 9 runs kept, 4 left; run the same command to finish: "
        "grace-dgc survey --preset quick --out 'runs/my q'"
    )
    monkeypatch.setattr(sys, "argv", ["python"])  # started from Python: its --preset and --out
    assert cli._interrupted_line(SurveyInterrupted(0, 9), args) == (
        "interrupted before any of its 9 runs finished: nothing kept; to run the survey: "
        "grace-dgc survey --preset quick --out runs/q"
    )


def test_the_demo_takes_your_own_compressor_by_file(tmp_path):
    from grace_dgc.demo import plan

    (tmp_path / "my_methods.py").write_text(
        "import grace_dgc\n\n\nclass Mine(grace_dgc.compressors.fp16.FP16Compressor):\n    pass\n"
    )
    spec = f"{tmp_path / 'my_methods.py'}:Mine"
    pairs = plan(f"{spec}:residual,{spec},topk:residual", workers=2)
    assert [memory for _, memory in pairs] == ["residual", "none", "residual"]
    assert pairs[0][0].endswith("my_methods.py:Mine") and pairs[2][0] == "topk"
