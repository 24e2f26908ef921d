"""Learning-rate tuning: each method's lr is chosen among its candidates by short runs scored
on a held-out split (the same split for every method), once per (method, workers, network)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch

from grace_survey.running.results import Record, append_record, read_records
from grace_survey.running.train import Split, _mix, train
from grace_survey.workloads import data

if TYPE_CHECKING:
    from grace_survey.config.cell import Cell
    from grace_survey.running.context import Context
    from grace_survey.workloads.registry import Workload


def holdout_split(workload: Workload, cell: Cell) -> tuple[Split, Split]:
    """(train part, held-out part): the workload's own validation split when it has one
    (PTB), else a seeded ``tune_holdout`` fraction of train (same for every method)."""
    if workload.valid is not None:
        return workload.train, workload.valid
    examples = data.size(workload.train)
    order = torch.randperm(examples, generator=torch.Generator().manual_seed(_mix("holdout", cell.data_seed)))
    held = max(1, int(round(examples * cell.tune_holdout)))
    keep, out = order[held:], order[:held]
    return data.subset(workload.train, keep), data.subset(workload.train, out)


def tune_lr(ctx: Context, cell: Cell, workload: Workload, out_dir: str, progress: bool = False) -> tuple[float, Record]:
    """Pick the lr among ``cell['tune_lr']`` with the best held-out accuracy after short
    runs (ties: lower held-out loss); reuse a recorded tuning of the same key."""
    key = cell.tuning_key
    existing: Record | None = None
    if ctx.rank == 0:
        existing = next(
            (r for r in reversed(read_records(out_dir)) if r.get("type") == "tuning" and r.get("tuning_key") == key),
            None,
        )
    existing = ctx.broadcast_object(existing)
    if existing is not None:
        return existing["chosen_lr"], existing
    train_part, held_part = holdout_split(workload, cell)
    epochs = cell.tune_epochs or max(1, workload.epochs // 4)
    candidates: list[dict[str, Any]] = []
    for lr in cast(list[float], cell.tune_lr):  # tuned only when it has candidates
        history, _ = train(
            ctx,
            cell,
            workload,
            lr,
            train_part,
            held_part,
            epochs,
            progress=progress,
            desc=f"tune {cell['label']} lr={lr:g}",
        )
        last = history[-1]
        candidates.append({"lr": lr, "heldout_accuracy": last["test_accuracy"], "heldout_loss": last["test_loss"]})

    def score(c: dict[str, Any]) -> tuple[float, float]:
        loss = c["heldout_loss"] if math.isfinite(c["heldout_loss"]) else math.inf
        return (c["heldout_accuracy"] if math.isfinite(c["heldout_accuracy"]) else -1.0, -loss)

    best = max(candidates, key=score)
    record = {
        "type": "tuning",
        "tuning_key": key,
        "label": cell.label,
        "workers": cell.workers,
        "network": cell.network["tag"],
        "seed": cell.seed,
        "tune_epochs": epochs,
        "holdout_size": data.size(held_part),
        "train_size": data.size(train_part),
        "candidates": candidates,
        "chosen_lr": best["lr"],
    }
    if ctx.rank == 0:
        append_record(out_dir, record)
    return best["lr"], record
