"""Script mode is two programs: what a user's training script imports (grace_survey.script.api)
and the survey's supervisor of the script's processes (grace_survey.script.supervisor), with
what both agree on in grace_survey.script.protocol. Every public name of the single module they
were is still importable from the package, and the names importers read from the API module
still work there."""

import importlib

import pytest

import grace_survey
from grace_survey import script
from grace_survey.script import api, protocol, supervisor

# every public name the single script-mode module defined before the split
BEFORE_THE_SPLIT = [
    "CELL_ENV",
    "DIR_ENV",
    "FAILED",
    "FINISHED",
    "MEASURED",
    "RENAMED",
    "REPORT_WAIT_S",
    "SCRIPT_RUNS",
    "STANDARD",
    "STARTED",
    "STRAGGLE_S",
    "cell",
    "cell_grace",
    "cell_seed",
    "check_launcher",
    "compose",
    "report_metrics",
    "run_script_cell",
]


@pytest.mark.parametrize("name", BEFORE_THE_SPLIT)
def test_every_public_name_of_the_old_module_is_in_the_package(name):
    assert name in script.__all__
    owner = next(module for module in (api, protocol, supervisor) if name in vars(module))
    assert getattr(script, name) is getattr(owner, name)


def test_each_side_holds_its_own_program():
    for name in ("cell", "cell_grace", "cell_seed", "report_metrics"):
        assert getattr(api, name).__module__ == api.__name__, name
    for name in ("run_script_cell", "compose", "_start", "_stop", "_wait", "_read_reports", "_tensorboard"):
        assert name in vars(supervisor) and name not in vars(api), name
    assert script.check_launcher is supervisor.check_launcher
    # the package's face and the names its other modules import from the API module
    for name in ("cell", "cell_grace", "cell_seed", "report_metrics"):
        assert getattr(grace_survey, name) is getattr(api, name)
    assert script.SCRIPT_RUNS == protocol.SCRIPT_RUNS == "script-runs"
    assert api.CELL_ENV == supervisor.CELL_ENV == "GRACE_DGC_CELL"


def test_the_script_side_does_not_import_the_supervisor_itself():
    """The API module's own imports stay the script's: the supervisor is reached only by the
    package (for its re-exports) and by the config's launcher check."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(importlib.import_module("grace_survey.script.api").__file__).read_text())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {node.module for node in top if isinstance(node, ast.ImportFrom)}
    modules |= {alias.name for node in top if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in modules if "supervisor" in m or m.startswith("grace_survey.running")}
    assert protocol.report_file("d", 3).endswith("rank3.jsonl")
