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
