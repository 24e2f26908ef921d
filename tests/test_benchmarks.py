"""The benchmark scripts run and write their figures into a README block (no timing is
asserted: figures belong to the benchmarks, not to tests)."""

import os
import sys

import pytest

import grace_dgc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_compressors


def test_bench_compressors_reports_every_method_and_writes_the_readme_block(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench_compressors:begin -->\nold figures\n<!-- bench_compressors:end -->\nrest\n")
    bench_compressors.main(["--sizes", "3000", "--repeats", "1", "--check", "--readme", str(readme)])
    printed = capsys.readouterr().out
    rows = {line.split()[0] for line in printed.splitlines() if line.strip()}
    assert set(grace_dgc.list_compressors()) <= rows
    assert "skipped" not in printed
    text = readme.read_text()
    assert text.startswith(
        "intro\n<!-- bench_compressors:begin -->\n```\n$ python benchmarks/bench_compressors.py "
        "--sizes 3000 --repeats 1 --check\n"
    )
    assert "old figures" not in text and text.endswith("<!-- bench_compressors:end -->\nrest\n")
    assert "--readme" not in text


def test_writing_into_a_readme_without_the_block_is_a_clear_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="no <!-- bench_compressors:begin -->"):
        bench_compressors.main(["--sizes", "2000", "--repeats", "1", "--only", "none", "--readme", str(readme)])


@pytest.mark.slow
def test_the_gpu_check_dry_run_writes_a_report_of_every_step(tmp_path):
    """`scripts/gpu_check.py --device cpu`: every step runs (tiny sizes) and the report holds
    each step's command, verdict and output — so the check works the day a GPU is lent."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "gpu_check.py"), "--device", "cpu", "--out", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    for step in (
        "CUDA tests",
        "compress + decompress vs copy_",
        "DGC selection",
        "dense-path overhead",
        "DGC vs dense",
    ):
        assert f"| {step}" in text and "FAILED" not in text
    assert "python benchmarks/bench_compressors.py --device cpu" in text and "# Survey report" in text


def test_a_gpu_check_step_that_hangs_is_killed_and_reported():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import gpu_check

    status, seconds, _ = gpu_check.run_step([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert status == "timeout" and seconds < 30
