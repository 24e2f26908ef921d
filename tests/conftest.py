"""Helpers shared by the test files, and the tiers (``--fast``).

The tests sit in folders by what they guard (tests/README.md); the helpers beside this file
(ranks.py, method_params.py, trainer_checks.py, hvd_worker.py) and each folder's modules import
one another by module name, as ranks kept up across tests unpickle their jobs by it: every
folder is on the import path from the start.
"""

import importlib.util
import os
import re
import sys
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = ("core", "training", "survey", "scripts")
sys.path[:0] = [p for p in (_HERE, *(os.path.join(_HERE, f) for f in FOLDERS)) if p not in sys.path]

import pytest  # noqa: E402
import ranks  # noqa: E402
import torch  # noqa: E402

from grace_dgc.registry import COMPRESSORS  # noqa: E402

# Without a GPU the fused kernels (tests/core/test_kernels.py) run under Triton's interpreter, which
# must be chosen before Triton is first imported: here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# libstdc++'s message when torch's gloo worker frees a finished collective's tensors after the
# interpreter began to shut down (docs/survey.md, "Your own script"): torch's, a few runs in 25 of a plain
# torch + gloo script on a loaded machine. It follows a complete run; anything else is a failure.
TEARDOWN_ABORT = "terminate called without an active exception"


def only_teardown_abort(returncode: int, stderr: str, finished: bool) -> bool:
    """A rank that ``finished`` its work (wrote its last output) and then died of that abort
    alone: SIGABRT, the message, and no Python traceback."""
    return finished and returncode == -6 and TEARDOWN_ABORT in stderr and "Traceback (most recent" not in stderr


def install_dummy_distribution(tmp_path, monkeypatch, name, entry_points):
    """A real (dummy) installed distribution on sys.path: ``name-1.0.dist-info`` with
    ``entry_points`` (entry_points.txt text); the compressor registry forgets its plugins, so
    the next look-up loads them afresh (undone after the test)."""
    dist = tmp_path / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(entry_points)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(COMPRESSORS, "_classes", dict(COMPRESSORS._classes))
    monkeypatch.setattr(COMPRESSORS, "_aliases", dict(COMPRESSORS._aliases))
    monkeypatch.setattr(COMPRESSORS, "_plugins_loaded", False)
    monkeypatch.setattr(COMPRESSORS, "broken", {})


def without_timings(state):
    """A Grace ``state_dict()`` whose counters keep the counts only: their seconds are measured,
    and a resumed run handshakes again (its control_* bytes grow), so neither can match an
    uninterrupted run's, while every count must (issue 53: the counters go on from the checkpoint)."""
    if "counters" not in state:
        return state
    counts = {key: value for key, value in state["counters"]["stats"].items() if not key.startswith("control")}
    return {**state, "counters": {"stats": counts, "steps": state["counters"]["steps"]}}


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help="the fast tier (make test-fast): every single-process test and the multi-rank or launching cases "
        "marked fast; the others are deselected (launches) or skipped at their first multi-rank job",
    )


def pytest_configure(config):
    ranks.FAST["on"] = config.getoption("--fast")
    if ranks.FAST["on"]:
        _route_process_starts_to_the_tier()


def _route_process_starts_to_the_tier():
    """Under --fast, every way a test starts processes skips it unless it is marked fast (the
    fast tier is every single-process test and the marked multi-rank cases)."""
    import subprocess

    from grace_dgc import launch

    def guarded(what, start):
        def start_unless_skipped(*args, **kwargs):
            ranks.skip_unless_fast(what)
            return start(*args, **kwargs)

        return start_unless_skipped

    launch.run_local = guarded("it starts ranks (run_local)", launch.run_local)
    launch.RankPool._start = guarded("it starts ranks (RankPool)", launch.RankPool._start)
    subprocess.Popen.__init__ = guarded("it starts a process", subprocess.Popen.__init__)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    kept, dropped = [], []
    for item in items:
        slow = item.get_closest_marker("launches") and not item.get_closest_marker("fast")
        (dropped if slow else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    ranks.FAST["item"] = item
    try:
        return (yield)
    finally:
        ranks.FAST["item"] = None
        if nextitem is None or nextitem.module is not item.module:
            ranks.close_all(engine="horovod")  # its idle ranks poll (Horovod's background loop): not kept


def pytest_sessionfinish(session):
    ranks.close_all()


# The survey's source, for the tests that read it (the environment it reads, the layering of
# the app on the library) without importing it: tests/core and tests/training import no survey.
SURVEY_SOURCE = Path(importlib.util.find_spec("grace_survey").origin).parent


# seconds of test time per folder in each part of make test on the 2-core reference machine (2 workers beside each
# other, then the cases marked alone: docs/development.md)
BUDGET_SECONDS = {"core": 500.0, "training": 480.0, "survey": 580.0, "scripts": 130.0}
_FOLDER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    parts = report.nodeid.split("::")[0].split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    _FOLDER_SECONDS[folder] = _FOLDER_SECONDS.get(folder, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Each folder's total beside its budget (docs/development.md, "The tests' time")."""
    if not _FOLDER_SECONDS:
        return
    terminalreporter.section("time per folder (setup + call + teardown)")
    for folder, seconds in sorted(_FOLDER_SECONDS.items(), key=lambda kv: -kv[1]):
        budget = BUDGET_SECONDS.get(folder)
        over = " — OVER BUDGET" if budget is not None and seconds > budget else ""
        shown = f" of a {budget:.0f} s budget" if budget is not None else ""
        terminalreporter.write_line(f"{folder:<10} {seconds:7.1f} s{shown}{over}")


def variables_read(source):
    """Names ``source``'s modules read from os.environ (literal names and NAME = "..." constants)."""
    found = set()
    for path in source.rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r"environ(?:\.get)?[\[(]\s*\"([A-Z_][A-Z0-9_]*)\"", text))
        found |= set(re.findall(r"\"([A-Z_][A-Z0-9_]*)\" in os\.environ", text))
        found |= set(re.findall(r"read_(?:int|flag)\(\s*\"([A-Z_][A-Z0-9_]*)\"", text))
        if "os.environ" in text or "read_int(" in text:
            for constant in re.findall(r"^[A-Z_]+ = \"([A-Z][A-Z0-9_]+)\"$", text, flags=re.M):
                found.add(constant)
            for group in re.findall(r"^[A-Z_]+ = \(((?:\"[A-Z_0-9]+\",? ?)+)\)$", text, flags=re.M):
                found |= set(re.findall(r"\"([A-Z_0-9]+)\"", group))
    return found - {"MASTER_ADDR", "MASTER_PORT"}  # set (not read) by launch.run_local for its children
