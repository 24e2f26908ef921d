"""One cell from start to summary: lr (tuned or the workload's), training, and the summary line
rank 0 appends to results.jsonl."""

import datetime
import os
import platform
import re
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.launch import Neighbours, conditions, launch_record
from grace_survey.config.cell import Cell
from grace_survey.running.context import Context
from grace_survey.running.results import Record, append_record
from grace_survey.running.train import load_workload, train
from grace_survey.running.tuning import tune_lr
from grace_survey.units import shown_path

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


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

    def on_epoch(record: Record) -> None:
        if ctx.rank == 0:
            append_record(out_dir, dict(base, type="epoch", **record))

    writer = _tensorboard(cell) if ctx.rank == 0 else None
    try:
        history, facts = train(
            ctx,
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
    mine = [at_start["threads"], at_start["threads_other"], time.process_time() - own_cpu]
    gathered = ctx.gather(mine)
    ranks = [{"threads": int(t), "threads_other": int(o)} for t, o, _ in gathered]
    ranks[0]["omp_num_threads"] = at_start["omp_num_threads"]
    others = neighbours.share(sum(cpu for _, _, cpu in gathered))  # the ranks share one machine here
    target = workload.target_accuracy
    reached = None if target is None else next((h for h in history if h["test_accuracy"] >= target), None)
    timed = [h for h in history if h["timed_steps"]] or history
    weights = [h["timed_steps"] or 1 for h in timed]

    def mean_step(key: str) -> float:  # per-step mean over the run (epochs weighted by their timed steps)
        return sum(h[key] * w for h, w in zip(timed, weights)) / sum(weights)

    last = history[-1]
    total_steps = sum(h["steps"] for h in history)
    train_time = last["elapsed_s"]
    summary = dict(
        base,
        type="summary",
        **cell.summary_fields(),
        workload=shown_path(workload.name),
        workload_description=workload.description,
        metric=workload.metric_name,
        loss=workload.loss if isinstance(workload.loss, str) else "custom",
        parameters=facts["parameters"],
        batch_size=workload.batch_size,
        global_batch=facts["global_batch"],
        lr=lr,
        lr_tuning=tuning,
        optimizer=workload.optimizer,
        momentum=workload.momentum,
        betas=list(workload.betas),
        weight_decay=workload.weight_decay,
        lr_schedule=workload.lr_schedule,
        warmup_steps=workload.warmup_steps,
        epochs=len(history),
        steps_per_epoch=facts["steps_per_epoch"],
        steps=total_steps,
        final_test_accuracy=last["test_accuracy"],
        final_test_loss=last["test_loss"],
        final_train_accuracy=last["train_accuracy"],
        final_train_loss=last["train_loss"],
        best_test_accuracy=max(h["test_accuracy"] for h in history),
        target_accuracy=target,
        epochs_to_target=reached["epoch"] if reached else None,
        time_to_target_s=reached["elapsed_s"] if reached else None,
        train_time_s=train_time,
        samples_per_s=total_steps * facts["global_batch"] / train_time,
        bytes_per_step=sum(h["bytes_per_step"] * h["steps"] for h in history) / total_steps,
        dense_bytes_per_step=sum(h["dense_bytes_per_step"] * h["steps"] for h in history) / total_steps,
        compression_ratio=(
            sum(h["bytes_per_step"] * h["steps"] for h in history)
            / max(sum(h["dense_bytes_per_step"] * h["steps"] for h in history), 1)
        ),
        exchanges_per_step=last["exchanges_per_step"],
        groups_per_step=last["groups_per_step"],
        peak_rss_mb=max(h["peak_rss_mb"] for h in history),
        peak_gpu_mb=max(h["peak_gpu_mb"] for h in history),
        device=str(ctx.device),
        backend=ctx.backend,
        engine=ctx.engine_kind,
        **host_fields(),
        launch=launch_record(launcher, ranks, at_start, others),
        started=started,
        finished=datetime.datetime.now().isoformat(timespec="seconds"),
        method_stats=last["method_stats"],
        shaping=netem_shaping(),
    )
    for key in ("compute_s", "compress_s", "communicate_s", "decompress_s", "wait_s", "step_s"):
        summary[key] = mean_step(key)
    if ctx.rank == 0:
        append_record(out_dir, summary)
        return summary
    return None


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


def host_fields() -> dict[str, str]:
    """The software and machine a run's summary records."""
    return {
        "torch": torch.__version__,
        "grace_dgc": grace_dgc.__version__,
        "host": socket.gethostname(),
        "python": platform.python_version(),
    }


def netem_shaping() -> dict[str, Any] | None:
    from grace_survey.running.netem import current_shaping

    return current_shaping()


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
