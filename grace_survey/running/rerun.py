"""What a survey run into an existing ``--out`` says before it trains: which runs it reuses,
which it runs again and why (the settings that changed, old → new), which are new, which
failed before; and the outputs an earlier configuration left that no longer hold (the
projection's files), removed once this survey records a run."""

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from grace_survey.config.cell import _UNHASHED, Cell
from grace_survey.running.results import CONFIG_JSON, Record

#: what ``grace-dgc project`` writes into a survey folder: made from its results as they were
PROJECTION_FILES = ("projection.md", "projection.csv", "projection.png", "projection-mesh.md")

_SHOWN_CHANGES = 3  # settings named in a re-run line; more are counted


def earlier_cells(out_dir: str) -> dict[str, Cell]:
    """run_id → cell of the configuration the last survey into ``out_dir`` saved
    (survey_config.json), read before this survey overwrites it; {} where there is none or
    it no longer loads (a plugin gone, an older format): the re-run lines then say less."""
    path = os.path.join(out_dir, CONFIG_JSON)
    if not os.path.isfile(path):
        return {}
    from grace_survey.config.settings import SurveyConfig

    try:
        with open(path) as f:
            config = SurveyConfig(json.load(f), source=path)
        return {cell.run_id: cell for cell in config.cells()}
    except Exception:  # whatever the old config's trouble, it only costs the detail of a line
        return {}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key, inner in value.items():
            flat.update(_flat(inner, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: value}


def _hashed(cell: Cell) -> dict[str, Any]:
    """The fields of ``cell`` that its fingerprint covers, flattened (``hyper.epochs``)."""
    flat = _flat({k: v for k, v in cell.as_dict().items() if k not in _UNHASHED})
    flat.pop("hyper.target_accuracy", None)
    return flat


def _name(key: str) -> str:
    """A setting as the config names it: ``hyper.epochs`` → epochs, ``method.params.x`` → x."""
    for prefix in ("hyper.", "method.params.", "method."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _shown(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def changes(old: Cell, new: Cell) -> str:
    """What differs between two cells of one run, as the re-run line says it:
    ``epochs changed 3 → 5, lr changed 0.1 → 0.05``; "" where nothing that is hashed does."""
    before, after = _hashed(old), _hashed(new)
    keys = [k for k in dict.fromkeys([*before, *after]) if before.get(k) != after.get(k)]
    said = [f"{_name(k)} changed {_shown(before.get(k))} → {_shown(after.get(k))}" for k in keys[:_SHOWN_CHANGES]]
    if len(keys) > _SHOWN_CHANGES:
        said.append(f"{len(keys) - _SHOWN_CHANGES} more setting(s) changed")
    return ", ".join(said)


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def plan_lines(
    cells: Sequence[Cell],
    done: Mapping[str, str | None],
    earlier: Mapping[str, Cell],
    records: Iterable[Record],
    out_dir: str,
) -> list[str]:
    """The lines a survey prints before it trains, where ``out_dir`` held earlier runs (none
    for a new folder): the runs reused, those run again grouped by what changed, the new ones,
    those that failed before, and the earlier runs this grid no longer names."""
    if not done and not earlier:
        return []
    errors = {r.get("run_id") for r in records if r.get("type") == "error"}
    reused, new, retried = 0, 0, 0
    reasons: dict[str, int] = {}
    for cell in cells:
        if cell.run_id not in done:
            if cell.run_id in errors:
                retried += 1
            else:
                new += 1
        elif done[cell.run_id] == cell.cell_hash:
            reused += 1
        else:
            old = earlier.get(cell.run_id)
            said = changes(old, cell) if old is not None and old.cell_hash == done[cell.run_id] else ""
            reason = said or "its settings changed since it ran"
            reasons[reason] = reasons.get(reason, 0) + 1
    lines = []
    if reused:
        lines.append(f"[survey] {_runs(reused)} already in {out_dir} with these settings: reused")
    for reason, count in reasons.items():
        lines.append(f"[survey] {reason}: {_runs(count)} re-run")
    if retried:
        lines.append(f"[survey] {_runs(retried)} that failed before: run again")
    if new:
        lines.append(f"[survey] {_runs(new)} not in {out_dir} yet: run")
    names = {cell.run_id for cell in cells}
    others = [run for run in done if run not in names]
    if others:
        lines.append(
            f"[survey] {_runs(len(others))} in {out_dir} not in this grid (another config's methods, "
            "workers or seeds): kept in results.jsonl, left out of the report"
        )
    return lines


def remove_stale_outputs(out_dir: str) -> list[str]:
    """Remove the projection's files from ``out_dir`` (made from its results before this
    survey recorded new runs); returns the names removed."""
    removed = []
    for name in PROJECTION_FILES:
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
            removed.append(name)
    return removed
