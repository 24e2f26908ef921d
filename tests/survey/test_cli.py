"""The ``grace-dgc`` command's errors (issue 18, "the first hour works"): a user's mistake is
one line on stderr naming the problem and the fix, exit status 2, no traceback, and a failed
survey leaves nothing half-written; a bug keeps its traceback; ``--debug`` shows it for
either; ``--version``. Every test fails before any rank or training starts."""

import importlib.metadata
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from grace_dgc.cli import main
from grace_dgc.errors import GraceConfigError, GraceDataError
from grace_survey.workloads import datasets
from grace_survey.workloads.registry import list_workloads

MNIST_CONFIG = 'workload = "mnist-mlp"\nepochs = 1\n[[methods]]\ncompressor = "none"\n'


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("GRACE_DGC_DEBUG", raising=False)


def cli(*args):
    """``main(argv)`` → (exit status, stderr line): argparse and the demo end in SystemExit, the
    survey tools return their status."""
    try:
        return main(list(args))
    except SystemExit as stop:
        return stop.code


def one_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and err.startswith("grace-dgc"), err
    return err.strip()


def config_file(tmp_path, text, name="survey.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def write_idx(path, array):
    """An IDX file: 00 00 08 <ndim>, big-endian sizes, uint8 data."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


# -- names: did you mean ------------------------------------------------------------------
@pytest.mark.launches
def test_a_misspelt_method_through_the_console_entry_point_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "grace_dgc.cli", "demo", "--methods", "topkk"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("grace-dgc: error: unknown compressor 'topkk'")
    assert "did you mean 'topk'?" in line.lower() and "qsgd" in line  # the suggestion and the accepted names
    assert proc.stdout == ""  # no rank started: the table header is not printed


@pytest.mark.launches
def test_a_reader_that_leaves_early_is_no_traceback():
    """grace-dgc list | head: the pipe closes before the table is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "grace_dgc.cli", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    errors = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and errors == "", errors


@pytest.mark.parametrize(
    ("methods", "expected"),
    [
        ("topk:residul", ["unknown memory 'residul'", "'residual'"]),
        ("topk:residual:x", ["--methods item 'topk:residual:x'", "compressor[:memory]"]),
        ("none,", ["--methods item ''", "compressor[:memory]"]),
    ],
)
def test_demo_methods_are_checked_before_any_rank_starts(capsys, methods, expected):
    assert cli("demo", "--methods", methods) == 2
    line = one_line(capsys)
    assert all(part in line for part in expected), line


@pytest.mark.parametrize(("flag", "value"), [("--workers", "0"), ("--steps", "-1")])
def test_demo_counts_must_be_positive(capsys, flag, value):
    assert cli("demo", flag, value) == 2
    assert f"{flag} {value} must be an int >= 1" in one_line(capsys)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["lst"], "invalid choice: 'lst' (did you mean 'list'?); accepted: list, demo, survey"),
        (
            ["survey", "--preset", "quik", "--out", "o"],
            "unknown preset 'quik' (did you mean 'quick'?); accepted: quick",
        ),
        (["survey", "--preset", "seed00-kpercent", "--out", "o"], "(did you mean 'seed000-kpercent'?)"),
        (["survey", "--preset", "quick"], "the following arguments are required: --out"),
        (["demo", "--workers", "two"], "argument --workers: invalid int value: 'two'"),
        ([], "the following arguments are required: command"),
    ],
)
def test_command_line_syntax_errors_are_one_line_with_a_pointer_to_help(capsys, argv, expected):
    assert cli(*argv) == 2
    line = one_line(capsys)
    assert expected in line and line.endswith("--help"), line


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('workload = "mnist1d-mlp"\nepoch = 3\n[[methods]]\ncompressor = "none"\n', "did you mean 'epochs'"),
        ('workload = "mnist1d-mpl"\n[[methods]]\ncompressor = "none"\n', "Did you mean 'mnist1d-mlp'?"),
        (
            'workload = "mnist1d-mlp"\n[[methods]]\ncompressor = "none"\ncommunicator = "allgathr"\n',
            "unknown communicator 'allgathr'. Did you mean 'allgather'?",
        ),
        ('workload = "mnist1d-mlp"\n[[methods]]\ncompresor = "none"\n', "did you mean 'compressor'"),
    ],
)
def test_config_names_suggest_the_closest(tmp_path, capsys, text, expected):
    out = tmp_path / "out"
    assert cli("survey", "--config", config_file(tmp_path, text), "--out", str(out)) == 2
    line = one_line(capsys)
    assert expected in line and "unknown" in line, line
    assert not out.exists()


def test_an_unknown_config_key_names_the_key_and_the_file(tmp_path, capsys):
    path = config_file(tmp_path, 'workload = "mnist1d-mlp"\nepoch = 3\n[[methods]]\ncompressor = "none"\n')
    assert cli("survey", "--config", path, "--out", str(tmp_path / "out")) == 2
    line = one_line(capsys)
    assert f"unknown key(s) 'epoch' in {path}" in line and "did you mean 'epochs' for 'epoch'?" in line
    assert "accepted: name, description, workload" in line


def test_a_missing_config_file(tmp_path, capsys):
    assert cli("survey", "--config", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "out")) == 2
    assert "nope.toml' does not exist" in one_line(capsys)
    assert not (tmp_path / "out").exists()


# -- data directories and files -----------------------------------------------------------
def test_a_nonexistent_data_dir_is_an_error_even_where_no_workload_reads_files(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    out = tmp_path / "out"
    assert cli("survey", "--preset", "quick", "--data-dir", str(missing), "--out", str(out)) == 2
    assert f"--data-dir {missing} does not exist" in one_line(capsys)
    assert not out.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli("survey", "--preset", "quick", "--data-dir", str(afile), "--out", str(out)) == 2
    assert f"--data-dir {afile} is a file, not a directory" in one_line(capsys)
    config = config_file(
        tmp_path, f'workload = "mnist-mlp"\ndata_dir = "{missing}"\n[[methods]]\ncompressor = "none"\n'
    )
    assert cli("survey", "--config", config, "--out", str(out)) == 2
    assert f"data_dir = '{missing}' in {config} does not exist" in one_line(capsys)
    assert not out.exists()


def test_missing_data_files_are_named_with_the_folder_searched_and_no_folder_is_created(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_idx(data / "train-images-idx3-ubyte", np.zeros((2, 28, 28)))
    write_idx(data / "train-labels-idx1-ubyte", np.zeros(2))
    config = config_file(tmp_path, MNIST_CONFIG)
    out = tmp_path / "results" / "nested" / "out"
    assert cli("survey", "--config", config, "--data-dir", str(data), "--out", str(out)) == 2
    line = one_line(capsys)
    assert "never downloads them" in line
    assert f"{data} lacks t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte;" in line  # what is missing, where
    assert f"looked in {data}, {data / 'mnist'}, {data / 'MNIST/raw'}" in line
    assert "pass --data-dir naming the directory that holds them" in line  # the fix
    assert not (tmp_path / "results").exists()
    assert cli("survey", "--config", config, "--out", str(out)) == 2  # no --data-dir at all
    assert "(no --data-dir given); pass --data-dir DIR" in one_line(capsys)


def corrupt_mnist(folder):
    folder.mkdir()
    for name in datasets.MNIST_FILES:
        (folder / name).write_bytes(b"\x89PNG not an idx file")


def test_a_corrupt_data_file_is_one_line_and_the_folder_it_created_is_removed(tmp_path, capsys):
    data = tmp_path / "data"
    corrupt_mnist(data)
    out = tmp_path / "out"
    assert (
        cli("survey", "--config", config_file(tmp_path, MNIST_CONFIG), "--data-dir", str(data), "--out", str(out)) == 2
    )
    line = one_line(capsys)
    assert "train-images-idx3-ubyte is not an IDX file (bad magic number" in line
    assert not out.exists()  # the run had created it (config, data cache) before reading the files


def test_a_folder_that_was_there_keeps_its_content_and_loses_what_the_run_added(tmp_path, capsys):
    data = tmp_path / "data"
    corrupt_mnist(data)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "survey_config.json").write_text(json.dumps({"name": "an earlier survey"}))
    argv = ["survey", "--config", config_file(tmp_path, MNIST_CONFIG), "--data-dir", str(data), "--out", str(kept)]
    assert cli(*argv) == 2
    one_line(capsys)
    assert sorted(os.listdir(kept)) == ["notes.txt", "survey_config.json"]  # no data-cache left
    assert (kept / "notes.txt").read_text() == "mine"
    assert json.loads((kept / "survey_config.json").read_text()) == {"name": "an earlier survey"}  # restored


def test_data_file_errors_keep_their_types():
    assert issubclass(GraceDataError, ValueError) and issubclass(datasets.MissingDataError, FileNotFoundError)
    assert set(datasets.WORKLOAD_FILES) <= set(list_workloads())


def test_check_files_reads_nothing_and_passes_generated_workloads(tmp_path):
    datasets.check_files("mnist1d-mlp", None)
    with pytest.raises(datasets.MissingDataError, match="ptb.train.txt"):
        datasets.check_files("ptb-lstm", str(tmp_path))
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in datasets.CIFAR_FILES:
        (folder / (name + ".gz")).write_bytes(b"")
    with pytest.raises(datasets.MissingDataError, match="unpack them there"):
        datasets.check_files("cifar10-resnet20", str(tmp_path))


def test_truncated_or_foreign_data_files_are_data_errors(tmp_path):
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(GraceDataError, match="ends after 6 bytes"):
        datasets.read_idx(str(tmp_path / "short"))
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(GraceDataError, match="not a readable gzip file"):
        datasets.read_idx(str(tmp_path / "bad.gz"))
    (tmp_path / "batch").write_bytes(b"\x80\x02")  # a pickle cut short
    with pytest.raises(GraceDataError, match="not a CIFAR-10 batch"):
        datasets._cifar_batch(str(tmp_path / "batch"))
    (tmp_path / "ptb.txt").write_bytes(b"\xff\xfe words")
    with pytest.raises(GraceDataError, match="not UTF-8 text"):
        datasets._ptb_words(str(tmp_path / "ptb.txt"))


# -- bugs, --debug, --version ---------------------------------------------------------------
def test_debug_shows_the_traceback_of_a_user_error(tmp_path, monkeypatch):
    argv = ["survey", "--preset", "quick", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]
    with pytest.raises(GraceConfigError, match="does not exist"):
        main(["--debug", *argv])
    with pytest.raises(GraceConfigError, match="does not exist"):
        main([*argv, "--debug"])
    with pytest.raises(GraceConfigError, match="unknown compressor"):
        main(["--debug", "demo", "--methods", "topkk"])
    monkeypatch.setenv("GRACE_DGC_DEBUG", "1")
    with pytest.raises(GraceConfigError, match="does not exist"):
        main(argv)
    assert not (tmp_path / "out").exists()


def test_a_bug_keeps_its_traceback_and_leaves_no_folder(tmp_path, monkeypatch):
    from grace_survey.running import grid

    def broken(config, out_dir, **kwargs):
        os.makedirs(os.path.join(out_dir, "data-cache"))
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(grid, "run_grid", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="a bug"):
        main(["survey", "--preset", "quick", "--out", str(out)])
    assert not out.exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"grace-dgc {importlib.metadata.version('grace_dgc')}\n"
