"""Helpers shared by the test files."""

import os

import torch

from grace_dgc.registry import COMPRESSORS

# Without a GPU the fused kernels (tests/test_kernels.py) run under Triton's interpreter, which
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
