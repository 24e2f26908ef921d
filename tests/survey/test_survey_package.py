"""The survey is its own import package, ``grace_survey`` (issue 41), and its old name keeps
working for one release: the same module objects, one DeprecationWarning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import grace_survey
import grace_survey.workloads.registry


def _fresh_import(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    for key in [k for k in sys.modules if k == "grace_dgc.survey" or k.startswith("grace_dgc.survey.")]:
        del sys.modules[key]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, caught


def test_the_old_name_warns_and_gives_the_same_api():
    old, caught = _fresh_import("grace_dgc.survey")
    assert [w.category for w in caught if "grace_survey" in str(w.message)] == [DeprecationWarning]
    for name in grace_survey.__all__:
        assert getattr(old, name) is getattr(grace_survey, name)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("grace_dgc.survey.workloads", "grace_survey.workloads"),
        ("grace_dgc.survey.script", "grace_survey.script"),
        ("grace_dgc.survey.report", "grace_survey.report"),
        ("grace_dgc.survey.config", "grace_survey.config.settings"),
    ],
)
def test_an_old_module_is_the_moved_module_itself(old, new):
    module, _ = _fresh_import(old)
    moved = importlib.import_module(new)
    assert module is moved
    assert moved.__spec__.name == new  # the alias did not stamp its own name on it
    assert moved.__name__ == new


def test_registering_through_the_old_name_reaches_the_new_registry():
    old, _ = _fresh_import("grace_dgc.survey.workloads")
    assert old.register_workload is grace_survey.workloads.registry.register_workload
    script, _ = _fresh_import("grace_dgc.survey.script")
    assert script.run_script_cell is importlib.import_module("grace_survey.script.supervisor").run_script_cell
    assert script.cell_grace is grace_survey.cell_grace


@pytest.mark.launches
def test_the_old_command_module_still_runs():
    done = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "grace_dgc.survey.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "survey" in done.stdout and "report" in done.stdout


def test_no_function_in_the_library_or_the_survey_is_over_60_lines():
    """Issue 41: every function reads on one screen (``def`` to its last line, docstring included)."""
    import ast
    import pathlib

    import grace_dgc

    long = []
    for package in (pathlib.Path(grace_dgc.__file__).parent, pathlib.Path(grace_survey.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name}")
    assert not long
