"""The launch conditions of a survey's runs, as its report states them: one line saying what
every run ran under, and a warning when the runs of one report ran under different thread
settings or on a busy machine (a launcher or a neighbour must never decide a comparison)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BUSY_SHARE = 0.25  # of the machine's CPU time used by other processes while a run trained: a busy machine


def _threads(run: Mapping[str, Any]) -> str:
    launch = run.get("launch") or {}
    threads = launch.get("threads") or []
    others = launch.get("threads_other") or []
    if not threads:
        return "not recorded"
    shown = "/".join(map(str, sorted(set(threads))))
    if others and set(others) != set(threads):
        shown += f" (threads started later: {'/'.join(map(str, sorted(set(others))))})"
    return shown


def launch_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Report lines (markdown list items) on the runs' launch conditions."""
    recorded = [r for r in runs if r.get("launch")]
    if not recorded:
        return ["- Launch conditions: not recorded (runs of grace_dgc before 2026-11-27)"]
    by_threads: dict[str, list[str]] = {}
    for run in recorded:
        by_threads.setdefault(_threads(run), []).append(str(run.get("run_id", "?")))
    launchers = sorted({str(r["launch"].get("launcher")) for r in recorded})
    shares = [r["launch"]["others_share"] for r in recorded if r["launch"].get("others_share") is not None]
    lines = [
        f"- Launch conditions: intra-op threads per rank {' | '.join(by_threads)}; launcher "
        f"{', '.join(launchers)}; {recorded[0]['launch'].get('cores')} cores; other processes used "
        + (f"{min(shares):.0%}–{max(shares):.0%} of the machine while the runs trained" if shares else "(not measured)")
    ]
    if len(by_threads) > 1:
        groups = "; ".join(
            f"{threads}: {', '.join(ids[:4])}{' …' if len(ids) > 4 else ''}" for threads, ids in by_threads.items()
        )
        lines.append(
            f"- **Warning: the runs did not all run with the same threads per rank** ({groups}); their times "
            "are not comparable. Run them under one launcher, or set OMP_NUM_THREADS for all of them"
        )
    unshared = [
        r for r in recorded if set(r["launch"].get("threads_other") or []) - set(r["launch"].get("threads") or [])
    ]
    if unshared:
        lines.append(
            f"- **Warning: in {len(unshared)} run(s) threads started after set-up (grace's communication thread) "
            "ran with other thread counts than the main thread**: set OMP_NUM_THREADS before torch starts"
        )
    busy = [r for r in recorded if (r["launch"].get("others_share") or 0) > BUSY_SHARE]
    if busy:
        ids = ", ".join(str(r.get("run_id", "?")) for r in busy[:4]) + (" …" if len(busy) > 4 else "")
        lines.append(
            f"- **Warning: {len(busy)} run(s) trained on a busy machine** (other processes used more than "
            f"{BUSY_SHARE:.0%} of its CPU time meanwhile: {ids}); their times carry the neighbours' load"
        )
    return lines
