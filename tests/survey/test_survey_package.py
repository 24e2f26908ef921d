"""The survey is its own import package, ``grace_survey`` (issue 41); the library's old alias
for it, ``grace_dgc.survey``, is gone (issue 55: a 0.1.0 never released needs no deprecation
shim), and a function reads on one screen."""

from __future__ import annotations

import importlib

import pytest

import grace_survey


def test_the_old_alias_is_gone_and_the_survey_is_grace_survey():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("grace_dgc.survey")
    survey = importlib.import_module("grace_survey")
    assert callable(survey.cell_grace) and callable(survey.report_metrics)


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
