"""One cell from start to summary: lr (tuned or the workload's), training, and the summary line
rank 0 appends to results.jsonl."""

import datetime
import functools
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from grace_dgc.errors import GraceConfigError
from grace_survey.config.cell import Cell
from grace_survey.running.conditions import Neighbours, conditions, launch_record
from grace_survey.running.context import Context
from grace_survey.running.results import Record, append_record
from grace_survey.running.summary import SummaryParts, byte_totals, mean_step_times, summary_record
from grace_survey.running.train import load_workload, train
from grace_survey.running.tuning import tune_lr
from grace_survey.units import shown_path

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from grace_survey.workloads.registry import Workload


def execute_cell(
    ctx: Context, cell: Cell, out_dir: str, progress: bool = False, launcher: str = "survey"
) -> Record | None:
    """Train one cell on this rank; rank 0 writes its epoch lines and summary line and
    returns the summary (other ranks return None). ``launcher`` is recorded in the summary's
    launch conditions: ``survey`` (ranks started for this run) or ``survey-pool`` (ranks kept
    up across runs, :class:`grace_dgc.launch.RankPool`)."""
    if ctx.size != cell.workers:
        raise GraceConfigError(f"cell {cell.run_id!r} wants {cell.workers} workers, the runtime has {ctx.size}")
    workload = load_workload(cell)
    tuning: Record | None = None
    if cell.tune_lr:
        lr, tuning = tune_lr(ctx, cell, workload, out_dir, progress)
    else:
        lr = workload.lr
    attempt = ctx.broadcast_object(uuid.uuid4().hex[:12])
    started = datetime.datetime.now().isoformat(timespec="seconds")
    at_start = conditions()  # this rank's threads and the machine's load as training starts
    neighbours, own_cpu = Neighbours(), time.process_time()
    base: Record = cell.record_head(attempt)
    history, facts = _train_logged(ctx, cell, workload, lr, base, out_dir, progress)
    if not history:  # a replica group other than 0 under torchft: group 0 records the run
        return None
    launch = _launch(ctx, launcher, at_start, neighbours, own_cpu)
    timed = [h for h in history if h["timed_steps"]] or history
    sent, dense = byte_totals(history)
    parts = SummaryParts(
        setup=_setup(workload, facts, lr, tuning),
        steps_per_epoch=facts["steps_per_epoch"],
        target_accuracy=workload.target_accuracy,
        samples_per_s=sum(h["steps"] for h in history) * facts["global_batch"] / history[-1]["elapsed_s"],
        compression_ratio=sent / max(dense, 1),
        device=str(ctx.device),
        backend=ctx.backend,
        engine=ctx.engine_kind,
        started=started,
        # per-step means over the run, epochs weighted by their timed steps
        step_times=mean_step_times(timed, [h["timed_steps"] or 1 for h in timed]),
        launch=launch,
    )
    summary = dict(summary_record(base, cell, history, parts), **facts.get("summary", {}))
    if ctx.rank == 0:
        append_record(out_dir, summary)
        return summary
    return None


def _train_logged(
    ctx: Context, cell: Cell, workload: "Workload", lr: float, base: Record, out_dir: str, progress: bool
) -> tuple[list[Record], dict[str, Any]]:
    """:func:`train` (a replica group under torchft: its context's own), rank 0 appending each
    epoch's line (and logging its scalars if asked)."""
    # a replica group under torchft trains its own way (grace_survey.running.faults.FaultContext.train)
    training: Any = getattr(ctx, "train", None) or functools.partial(train, ctx)

    def on_epoch(record: Record) -> None:
        if ctx.rank == 0:
            append_record(out_dir, dict(base, type="epoch", **record))

    writer = _tensorboard(cell) if ctx.rank == 0 else None
    try:
        return training(
            cell,
            workload,
            lr,
            workload.train,
            workload.test,
            workload.epochs,
            on_epoch=on_epoch,
            progress=progress,
            desc=cell.run_id,
            scalars=None if writer is None else _scalars(writer),
        )
    finally:
        if writer is not None:
            writer.close()


def _launch(
    ctx: Context, launcher: str, at_start: Mapping[str, Any], neighbours: Neighbours, own_cpu: float
) -> dict[str, object]:
    """The launch record: every rank's threads (gathered: every rank calls this) and the share
    of the machine others used while the ranks, all on this machine, trained."""
    mine = [at_start["threads"], at_start["threads_other"], time.process_time() - own_cpu]
    gathered = ctx.gather(mine)
    ranks = [{"threads": int(t), "threads_other": int(o)} for t, o, _ in gathered]
    ranks[0]["omp_num_threads"] = at_start["omp_num_threads"]
    others = neighbours.share(sum(cpu for _, _, cpu in gathered))  # the ranks share one machine here
    return launch_record(launcher, ranks, at_start, others)


def _setup(workload: "Workload", facts: Mapping[str, int], lr: float, tuning: Record | None) -> Record:
    """What ran, as the summary line says it: the workload, its size and its training settings."""
    return {
        "workload": shown_path(workload.name),
        "workload_description": workload.description,
        "metric": workload.metric_name,
        "loss": workload.loss if isinstance(workload.loss, str) else "custom",
        "parameters": facts["parameters"],
        "batch_size": workload.batch_size,
        "global_batch": facts["global_batch"],
        "lr": lr,
        "lr_tuning": tuning,
        "optimizer": workload.optimizer,
        "momentum": workload.momentum,
        "betas": list(workload.betas),
        "weight_decay": workload.weight_decay,
        "lr_schedule": workload.lr_schedule,
        "warmup_steps": workload.warmup_steps,
    }


def _tensorboard(cell: Cell) -> "SummaryWriter | None":
    """A SummaryWriter in ``tensorboard_dir/<run id>`` when the survey asked for one."""
    if not cell.tensorboard_dir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(os.path.join(cell.tensorboard_dir, re.sub(r"[^\w.@-]+", "_", cell.run_id)))


def _scalars(writer: "SummaryWriter") -> Callable[[int, Mapping[str, float]], None]:
    def log(step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)

    return log


def run_cell(
    rank: int,
    world_size: int,
    cell: Cell,
    out_dir: str,
    progress: bool = False,
    device: str = "auto",
    launcher: str = "survey",
) -> Record | None:
    """:func:`grace_dgc.launch.run_local` (or :class:`~grace_dgc.launch.RankPool`) entry
    point: one rank of one cell."""
    return execute_cell(Context.detect(device), cell, out_dir, progress, launcher)
