"""The benchmark scripts run and write their figures into a README block (no timing is
asserted: figures belong to the benchmarks, not to tests)."""

import os
import sys

import pytest

import grace_dgc

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
)

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


@pytest.mark.launches
def test_the_gpu_check_dry_run_writes_a_report_of_every_step(tmp_path):
    """`scripts/gpu_check.py --device cpu`: every step runs (tiny sizes) and the report holds
    each step's command, verdict and output — so the check works the day a GPU is lent."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "gpu_check.py"), "--device", "cpu", "--out", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    for number, step in enumerate(
        (
            "CUDA tests",
            "fused kernels vs torch ops",
            "compress + decompress vs copy_",
            "compress + decompress vs copy_, torch ops only",
            "DGC selection",
            "dense-path overhead",
            "dense-path overhead, host-bound",
            "DGC vs dense",
            "where the dense step's time goes",
        ),
        start=1,
    ):
        assert f"| {number}. {step}" in text and "FAILED" not in text and "not run" not in text
    assert "python benchmarks/bench_compressors.py --device cpu" in text and "# Survey report" in text
    assert "GRACE_DGC_KERNELS=torch python benchmarks/bench_compressors.py" in text
    assert "pack_signs" in text and "- Triton " in text
    assert "===== step, optimizer" in text and "grace per step (1 groups): compress" in text


def gpu_check_module():
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
    )
    import gpu_check

    return gpu_check


def test_a_gpu_check_past_its_budget_lists_the_steps_left_and_how_to_run_them(tmp_path, capsys):
    gpu_check = gpu_check_module()
    report = tmp_path / "report.md"
    assert gpu_check.main(["--device", "cpu", "--out", str(report), "--budget", "5", "--steps", "2,4-5"]) == 1
    text = report.read_text()
    assert "| 2. fused kernels vs torch ops | not run: the --budget of 5 s was spent | 0 |" in text
    assert "Steps 2,4,5 were not run within the budget: `python scripts/gpu_check.py --steps 2,4,5` runs them." in text
    assert "| 1. " not in text and "| 3. " not in text


def test_gpu_check_steps_are_checked():
    gpu_check = gpu_check_module()
    assert gpu_check.chosen_steps("1,3-5", 7) == [1, 3, 4, 5] and gpu_check.chosen_steps(None, 3) == [1, 2, 3]
    with pytest.raises(SystemExit, match="steps are numbered 1 to 7"):
        gpu_check.chosen_steps("0-2", 7)
    with pytest.raises(SystemExit, match="expected numbers and ranges like 1,3-5"):
        gpu_check.chosen_steps("two", 7)


def test_a_gpu_check_step_that_hangs_is_killed_and_reported():
    gpu_check = gpu_check_module()

    status, seconds, _ = gpu_check.run_step([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert status == "timeout" and seconds < 30
