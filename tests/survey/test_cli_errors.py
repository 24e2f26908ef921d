"""The command line's user errors: one line on stderr naming the problem and the fix, exit 2,
no traceback; ``--version``."""

import subprocess
import sys

import pytest

from grace_dgc import GraceConfigError, __version__
from grace_dgc.cli import main


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "grace_dgc.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.launches
def test_a_misspelled_method_is_one_line_with_a_suggestion():
    proc = run_cli("demo", "--methods", "topkk:residual")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "unknown compressor 'topkk'" in lines[0] and "Did you mean 'topk'?" in lines[0]


def test_a_misspelled_memory_is_named_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--methods", "topk:residul"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown memory 'residul'" in err and "'residual'" in err


def test_an_unknown_config_key_suggests_the_right_one(tmp_path, capsys):
    config = tmp_path / "survey.toml"
    config.write_text('workload = "mnist1d-mlp"\nepoch = 3\n[[methods]]\ncompressor = "none"\n')
    assert main(["survey", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "unknown key(s) 'epoch' in " in err and "did you mean 'epochs' for 'epoch'?" in err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_a_missing_data_dir_is_an_error_even_for_a_preset_that_needs_none(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["survey", "--preset", "quick", "--data-dir", str(missing), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--data-dir {missing} does not exist" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.launches
def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"grace-dgc {__version__}"


def test_missing_data_files_are_one_line_and_leave_no_output_behind(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    config = tmp_path / "survey.toml"
    config.write_text('workload = "mnist-mlp"\nepochs = 1\n[[methods]]\ncompressor = "none"\n')
    out = tmp_path / "out"
    assert main(["survey", "--config", str(config), "--data-dir", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "never downloads them" in err and "train-images-idx3-ubyte" in err
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(["survey", "--config", str(config), "--data-dir", str(data), "--out", str(kept)]) == 2
    assert (kept / "notes.txt").read_text() == "mine"  # a folder that was there is never removed


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"workload = " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested too deeply"),
        (b'workload = "mnist1d-mlp"\nname = "\xff\xfe"\n', "not UTF-8 text"),
        (b"workload = \n", "not valid TOML"),
        (b'workload = "mnist1d-mlp"\nworkers = 1000000000000000000\n', "must be an int >= 1 and <= 65536"),
        (b'workload = "mnist1d-mlp"\nepochs = 1000000000000000000000\n', "epochs="),
        (b'workload = "mnist1d-mlp"\n[[methods]]\ncompressor = "none"\ntune_lr = [inf]\n', "finite learning rates"),
    ],
)
def test_hostile_config_files_are_one_line_errors_naming_the_file(tmp_path, capsys, content, message):
    config = tmp_path / "bad.toml"
    config.write_bytes(content)
    assert main(["survey", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_out_naming_a_file_is_an_error(tmp_path, capsys):
    config = tmp_path / "survey.toml"
    config.write_text('workload = "mnist1d-mlp"\n[[methods]]\ncompressor = "none"\n')
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert main(["survey", "--config", str(config), "--out", str(taken)]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert taken.read_text() == "a file"


def test_a_hierarchical_survey_is_checked_on_the_workers_it_runs_with():
    from grace_survey.config.settings import SurveyConfig

    method = {"compressor": "topk", "communicator": "hierarchical", "params": {"group_size": 2}}
    assert SurveyConfig({"workload": "mnist1d-mlp", "workers": 4, "methods": [method]}).workers == [4]
    with pytest.raises(GraceConfigError, match=r"on 3 workers: hierarchical: 3 ranks do not form nodes"):
        SurveyConfig({"workload": "mnist1d-mlp", "workers": [4, 3], "methods": [method]})
