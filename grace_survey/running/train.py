"""Training one model for a survey cell: the seeded model and data order, the measured step
loop, evaluation. See :mod:`grace_survey.running.runner` for what each measurement means."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.stats import GRACE_KEYS
from grace_dgc.training.schedules import OuterSync
from grace_dgc.training.schedules import accepted_params as accepted_schedule_params
from grace_dgc.training.schedules import create as create_schedule
from grace_dgc.training.schedules.adam import AdamSchedule
from grace_survey.extras import require
from grace_survey.running.metrics import RankTotals, epoch_record
from grace_survey.workloads import data
from grace_survey.workloads.data import Split

if TYPE_CHECKING:
    from grace_dgc.grace import Grace
    from grace_survey.config.cell import Cell
    from grace_survey.running.context import Context
    from grace_survey.running.results import Record
    from grace_survey.workloads.registry import Workload


def load_workload(cell: Cell) -> Workload:
    from grace_survey.workloads.registry import get_workload

    data_dir = cell.data_dir
    if data_dir is None and cell.workload.startswith("mnist1d") and cell.cache_dir:
        data_dir = cell.cache_dir  # mnist1d keeps its generated arrays there
    return get_workload(cell.workload, data_dir=data_dir, seed=cell.data_seed, **cell.workload_options, **cell.hyper)


def _mix(*numbers: object) -> int:
    """A 63-bit seed from ints (stable across runs and platforms)."""
    digest = hashlib.blake2b(",".join(map(str, numbers)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


Objective = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, int]]


def objective(workload: Workload | None) -> Objective:
    """``score(output, targets) -> (mean loss, Σ metric, count)`` for ``workload``: its loss
    (cross-entropy, next-token cross-entropy for "lm", or its own function) and its metric
    (argmax accuracy unless it brings one)."""
    loss_fn = "cross_entropy" if workload is None else workload.loss
    metric = None if workload is None else workload.metric
    where = f"workload {getattr(workload, 'name', '')!r}"

    def score(output: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, int]:
        if callable(loss_fn):
            loss = loss_fn(output, targets)
            if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point()):
                raise GraceConfigError(
                    f"{where}: loss(output, targets) returned {_shown(loss)}; it must return the batch's mean "
                    "loss as a one-element floating tensor (with a gradient)"
                )
        if loss_fn == "lm" or (not callable(loss_fn) and output.dim() == 3):  # (N, T, vocab) vs next tokens (N, T)
            output = output.reshape(-1, output.shape[-1])
            targets = targets.reshape(-1)
        if not callable(loss_fn):
            loss = F.cross_entropy(output, targets)
        if metric is None:
            return loss, (output.argmax(dim=-1) == targets).sum(), targets.numel()
        return (loss, *_metric_value(metric(output, targets), where))

    return score


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _metric_value(value: object, where: str) -> tuple[Tensor, int]:
    """A metric's (Σ score, count) as (0-d tensor, int), or an error saying what it must return."""
    total, count, ok = torch.zeros((), dtype=torch.float64), 0, False
    if isinstance(value, (tuple, list)) and len(value) == 2:
        try:
            total = torch.as_tensor(value[0]).detach().reshape(()).double()
            count = int(torch.as_tensor(value[1]).reshape(()).item())
            ok = bool(torch.isfinite(total)) and count >= 0
        except (TypeError, ValueError, RuntimeError):
            ok = False
    if not ok:
        raise GraceConfigError(
            f"{where}: metric(output, targets) returned {_shown(value)}; it must return (sum of the batch's scores, "
            "number of scores) as finite numbers or one-element tensors, e.g. ((pred == y).sum(), len(y))"
        )
    return total, count


def evaluate(
    ctx: Context, model: nn.Module, split: Split, batch_size: int, workload: Workload | None = None
) -> tuple[float, float]:
    """(loss, metric) on ``split`` (accuracy unless ``workload`` brings its own metric),
    sharded over ranks and summed; floating buffers
    (BatchNorm statistics, which each rank updates from its own batches) are averaged
    over ranks first so every rank evaluates the same model."""
    if ctx.size > 1:
        with torch.no_grad():
            for buffer in model.buffers():
                if buffer.is_floating_point():
                    summed = ctx.engine.allreduce(buffer.detach().clone())
                    buffer.copy_(summed / ctx.size)
    shard = torch.arange(ctx.rank, data.size(split), ctx.size)
    score = objective(workload)
    loss_sum = hits = count = 0.0
    model.eval()
    with torch.no_grad():
        index_batches = [shard[start : start + batch_size] for start in range(0, len(shard), batch_size)]
        for x, y in data.batches(split, index_batches, getattr(workload, "loader_workers", 0)):
            x, y = x.to(ctx.device), y.to(ctx.device)
            loss, correct, n = score(model(x), y)
            loss_sum += loss.item() * n
            hits += correct.item()
            count += n
    loss_sum, hits, count = ctx.sum([loss_sum, hits, count])
    return loss_sum / max(count, 1), hits / max(count, 1)


def reset_peak_rss() -> None:
    """Start this process's peak-RSS count afresh where the kernel allows it (Linux: writing 5
    to /proc/self/clear_refs resets VmHWM), so a run's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: VmHWM from /proc/self/status on Linux. Not
    ``ru_maxrss``: Linux carries it across exec, so every rank a launcher spawns would report
    the launcher's peak (the survey's "390.9 MB" for every run). ``ru_maxrss`` elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB; macOS would be bytes


def _peak_memory(ctx: Context) -> tuple[float, float]:
    gpu_mb = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else 0.0
    return peak_rss_mb(), gpu_mb


def make_optimizer(workload: Workload, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The workload's optimizer: SGD with its momentum and weight decay, or AdamW with its
    betas and (decoupled) weight decay, as nanoGPT trains."""
    if workload.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=workload.betas, weight_decay=workload.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=workload.momentum, weight_decay=workload.weight_decay)


def lr_at(workload: Workload, lr: float, epoch: int, step: int, total_steps: int) -> float:
    """The learning rate of global step ``step`` (from 0) of ``total_steps``, in ``epoch``:
    ``lr_schedule = "step"`` multiplies lr by lr_gamma at each milestone epoch; ``"cosine"``
    decays it from lr to lr/10 over the steps after the warm-up (nanoGPT's ``get_lr``). A
    warm-up of ``warmup_steps`` ramps it linearly first: lr·(step + 1)/(warmup_steps + 1)."""
    warmup = workload.warmup_steps
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if workload.lr_schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        floor = lr / 10
        return floor + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - floor)
    return lr * workload.lr_gamma ** sum(epoch >= m for m in workload.lr_milestones)


@dataclasses.dataclass
class _Training:
    """What the epochs and steps of one :func:`train` share: the model, its optimizer and the
    Grace that exchanges its gradients, what a step measures, the run's sizes, and the step count."""

    ctx: Context
    cell: Cell
    workload: Workload
    lr: float
    model: nn.Module
    grace: Grace
    optimizer: torch.optim.Optimizer
    dist_opt: grace_dgc.DistributedOptimizer | OuterSync | AdamSchedule
    measured: Any  # whose stats a step records: the Adam schedules add their dense exchanges (a second Grace)
    scheduled: bool  # the method has a schedule (its dense bytes: dense_per_step)
    dense_per_step: int  # what a step-by-step fp32 allreduce would send: a schedule's ratio is against it
    score: Objective
    epochs: int
    examples: int
    steps: int  # per epoch
    scalars: Callable[[int, dict[str, float]], object] | None
    global_step: int = 0

    @property
    def per_worker(self) -> int:
        return self.workload.batch_size

    @property
    def global_batch(self) -> int:
        return self.workload.batch_size * self.ctx.size

    def lr_now(self, epoch: int) -> float:
        """The learning rate of the current step (:func:`lr_at`)."""
        return lr_at(self.workload, self.lr, epoch, self.global_step, self.epochs * self.steps)


def train(
    ctx: Context,
    cell: Cell,
    workload: Workload,
    lr: float,
    train_split: Split,
    eval_split: Split,
    epochs: int,
    on_epoch: Callable[[Record], object] | None = None,
    progress: bool = False,
    desc: str | None = None,
    scalars: Callable[[int, dict[str, float]], object] | None = None,
) -> tuple[list[Record], dict[str, int]]:
    """Train one model from its seeded init; returns (history, totals).

    ``on_epoch(record)`` gets each epoch's record (every rank calls it; the caller writes
    on rank 0); ``scalars(step, {tag: value})``, if given, gets per-step and per-epoch
    scalars on rank 0 (the TensorBoard log). Evaluation time is not training time.
    """
    run, train_split = _start(ctx, cell, workload, lr, train_split, epochs, scalars)
    reset_peak_rss()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    bar = _progress_bar(epochs * run.steps, desc, progress and ctx.rank == 0)
    history: list[Record] = []
    try:
        for epoch in range(epochs):
            elapsed = history[-1]["elapsed_s"] if history else 0.0
            record = _train_epoch(run, epoch, train_split, eval_split, elapsed, bar)
            history.append(record)
            bar.set_postfix(epoch=epoch + 1, test_acc=f"{record['test_accuracy']:.3f}")
            if on_epoch is not None:
                on_epoch(record)
    finally:
        bar.close()
        if isinstance(run.dist_opt, grace_dgc.DistributedOptimizer):
            run.dist_opt.remove_hooks()
        run.grace.close()  # its own process group: a pool's ranks run many runs
    return history, {
        "global_batch": run.global_batch,
        "steps_per_epoch": run.steps,
        "parameters": sum(p.numel() for p in run.model.parameters()),
    }


def _start(
    ctx: Context,
    cell: Cell,
    workload: Workload,
    lr: float,
    train_split: Split,
    epochs: int,
    scalars: Callable[[int, dict[str, float]], object] | None,
) -> tuple[_Training, Split]:
    """The run's model and method (:func:`_build`), sized (:func:`_epoch_size`), and the
    training split where the steps read it."""
    model, grace, optimizer, dist_opt = _build(ctx, cell, workload, lr)
    train_split, steps = _epoch_size(ctx, cell, workload, train_split)
    run = _Training(
        ctx=ctx,
        cell=cell,
        workload=workload,
        lr=lr,
        model=model,
        grace=grace,
        optimizer=optimizer,
        dist_opt=dist_opt,
        measured=dist_opt if isinstance(dist_opt, AdamSchedule) else grace,
        scheduled=cell.method.get("schedule") is not None,
        dense_per_step=4 * sum(p.numel() for p in model.parameters()),
        score=objective(workload),
        epochs=epochs,
        examples=data.size(train_split),
        steps=steps,
        scalars=scalars,
    )
    return run, train_split


def _progress_bar(total: int, desc: str | None, shown: bool) -> Any:
    """The steps' progress bar (tqdm; disabled unless ``shown``). Its lock is one of this
    process's threads: tqdm's default, a named semaphore made in a spawned rank, outlives a
    rank its launcher stops (Ctrl-C) as "leaked semaphore objects" at exit."""
    tqdm = require("tqdm.auto", "the survey's progress bars").tqdm
    if "_lock" not in vars(tqdm):
        tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc=desc, position=1, leave=False, unit="step", dynamic_ncols=True, disable=not shown)


def _build(
    ctx: Context, cell: Cell, workload: Workload, lr: float
) -> tuple[nn.Module, Grace, torch.optim.Optimizer, grace_dgc.DistributedOptimizer | OuterSync | AdamSchedule]:
    """The seeded model (the same initial weights for every method), the cell's Grace, the
    workload's optimizer and what steps it: a DistributedOptimizer, or the method's schedule."""
    method = cell.method
    params = dict(method["params"])
    from grace_dgc.registry import COMPRESSORS

    if "seed" in COMPRESSORS.accepted_params(method["compressor"]) and "seed" not in params:
        params["seed"] = cell.seed  # a stochastic method's own randomness follows the run seed

    torch.manual_seed(cell.seed)
    model = workload.make_model().to(ctx.device)
    grace = grace_dgc.build(
        method["compressor"], method["memory"], method["communicator"], engine=ctx.grace_engine, **params
    )
    optimizer = make_optimizer(workload, model, lr)
    fusion = {"fusion_bytes": method["fusion_bytes"]} if "fusion_bytes" in method else {}
    schedule = method.get("schedule")
    if schedule is None:
        return (
            model,
            grace,
            optimizer,
            grace_dgc.DistributedOptimizer(optimizer, grace, model.named_parameters(), **fusion),
        )
    # the workload's optimizer steps locally; the Grace carries the outer gradient
    settings = dict(schedule["params"])
    if workload.grad_clip and "max_grad_norm" in accepted_schedule_params(schedule["name"]):
        # the Adam schedules clip the gradient they use (the dense average where they average it)
        settings.setdefault("max_grad_norm", workload.grad_clip)
    dist_opt = create_schedule(schedule["name"], optimizer, grace, model.named_parameters(), **fusion, **settings)
    return model, grace, optimizer, dist_opt


def _epoch_size(ctx: Context, cell: Cell, workload: Workload, train_split: Split) -> tuple[Split, int]:
    """The training split where the steps read it (on the GPU when held as tensors) and the
    optimizer steps per epoch: whole global batches, at most ``max_steps``."""
    if ctx.device.type == "cuda" and not data.is_streamed(train_split):
        train_split = tuple(t.to(ctx.device) for t in train_split)  # type: ignore[union-attr, assignment]
    examples = data.size(train_split)
    per_worker = workload.batch_size
    global_batch = per_worker * ctx.size
    steps = examples // global_batch
    if steps == 0:
        raise GraceConfigError(
            f"batch_size {per_worker} × {ctx.size} workers = {global_batch} exceeds the {examples} "
            f"training samples of {workload.name!r}; lower batch_size or workers"
        )
    if cell.max_steps:
        steps = min(steps, cell.max_steps)
    return train_split, steps


def _train_epoch(run: _Training, epoch: int, train_split: Split, eval_split: Split, elapsed: float, bar: Any) -> Record:
    """One epoch's steps, its closing synchronization (a schedule's), the evaluation, and the
    epoch's record from every rank's totals."""
    ctx = run.ctx
    epoch_lr = run.lr_now(epoch)
    run.grace.set_epoch(epoch)
    loader, augment_rng = _epoch_batches(run, epoch, train_split)
    run.model.train()
    totals = RankTotals()
    method_stats: dict[str, Any] = {}
    ctx.sync()
    epoch_start = time.perf_counter()
    for _ in range(run.steps):
        method_stats = _train_step(run, epoch, epoch_lr, loader, augment_rng, totals)
        bar.update()
    # a schedule ends the epoch with a synchronization: the evaluated model is the ranks'
    # common one (its bytes and time count as the epoch's)
    if isinstance(run.dist_opt, (OuterSync, AdamSchedule)) and run.dist_opt.synchronize_now():
        stats = run.measured.stats()
        run.measured.reset_stats()
        totals.bytes_sent += stats["bytes_sent"]
        totals.exchanges += stats["tensors"]
        totals.groups += stats["groups"]
    ctx.sync()
    totals.train_time = time.perf_counter() - epoch_start
    totals.peak_rss_mb, totals.peak_gpu_mb = _peak_memory(ctx)
    ranks = [RankTotals.from_list(values) for values in ctx.gather(totals.as_list())]
    test_loss, test_acc = evaluate(ctx, run.model, eval_split, run.cell.eval_batch_size, run.workload)
    record = epoch_record(
        ranks, epoch + 1, epoch_lr, run.steps, run.global_batch, elapsed, test_loss, test_acc, method_stats
    )
    if run.scalars is not None and ctx.rank == 0:
        run.scalars(
            run.global_step,
            {
                "epoch/test_accuracy": test_acc,
                "epoch/test_loss": test_loss,
                "epoch/train_loss": record["train_loss"],
                "epoch/bytes_per_step": record["bytes_per_step"],
            },
        )
    return record


def _epoch_batches(
    run: _Training, epoch: int, train_split: Split, first: int = 0
) -> tuple[Iterator[tuple[Tensor, Tensor]], torch.Generator]:
    """This rank's batches of the epoch from its step ``first`` on (the permutation drawn from
    (seed, epoch)) and the generator its augmentation draws from (seeded from (seed, epoch, rank))."""
    ctx, seed = run.ctx, run.cell.seed
    order = torch.randperm(run.examples, generator=torch.Generator().manual_seed(_mix(seed, epoch)))
    augment_rng = torch.Generator().manual_seed(_mix(seed, epoch, "augment", ctx.rank))
    if ctx.device.type == "cuda" and not data.is_streamed(train_split):
        order = order.to(ctx.device)
    # this rank's rows of each global batch: the same examples in the same order for
    # every method, whether the split is held as tensors or streamed from a Dataset
    start = ctx.rank * run.per_worker
    mine = [order[step * run.global_batch + start :][: run.per_worker] for step in range(first, run.steps)]
    loader = data.batches(train_split, mine, run.workload.loader_workers, pin_memory=ctx.device.type == "cuda")
    return loader, augment_rng


def _train_step(
    run: _Training,
    epoch: int,
    epoch_lr: float,
    loader: Iterator[tuple[Tensor, Tensor]],
    augment_rng: torch.Generator,
    totals: RankTotals,
) -> dict[str, Any]:
    """One measured optimizer step, added to ``totals``; returns the method's own stats."""
    ctx, workload = run.ctx, run.workload
    for group in run.optimizer.param_groups:
        group["lr"] = run.lr_now(epoch)
    x, y = next(loader)
    if workload.augment is not None:
        x = workload.augment(x, augment_rng)
    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
    ctx.sync()
    t0 = time.perf_counter()
    run.dist_opt.zero_grad()
    loss, hits, count = run.score(run.model(x), y)
    loss.backward()
    ctx.sync()
    t1 = time.perf_counter()
    _update(run)
    ctx.sync()
    t2 = time.perf_counter()
    stats = run.measured.stats()
    run.measured.reset_stats()
    _add_step(run, totals, stats, loss.item() * count, hits.item(), count, t1 - t0, t2 - t1)
    if run.scalars is not None and ctx.rank == 0:
        run.scalars(
            run.global_step,
            {
                "train/loss": loss.item(),
                "train/bytes_sent": stats["bytes_sent"],
                "train/step_s": t2 - t0,
                "train/lr": epoch_lr,
            },
        )
    run.global_step += 1
    return {k: v for k, v in stats.items() if k not in GRACE_KEYS}


def _update(run: _Training) -> None:
    """The step's update, the gradient clipped where the workload asks for it."""
    dist_opt, grad_clip = run.dist_opt, run.workload.grad_clip
    if grad_clip and isinstance(dist_opt, grace_dgc.DistributedOptimizer):
        dist_opt.synchronize()  # clip the averaged gradient, then update once
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), grad_clip)
        dist_opt.step()  # after synchronize(): no second exchange; a NaN step is skipped
    else:
        if grad_clip and not isinstance(dist_opt, AdamSchedule):
            # DiLoCo, local SGD: the local gradient, before the local step
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), grad_clip)
        dist_opt.step()


def _add_step(
    run: _Training,
    totals: RankTotals,
    stats: dict[str, Any],
    loss_sum: float,
    hits: float,
    count: int,
    compute: float,
    wait: float,
) -> None:
    """One step's loss, hits, bytes and (past ``timing_skip_steps``) times into the epoch's totals."""
    totals.loss += loss_sum
    totals.hits += hits
    totals.count += count
    totals.bytes_sent += stats["bytes_sent"]
    totals.dense_bytes += run.dense_per_step if run.scheduled else stats["dense_bytes"]
    totals.exchanges += stats["tensors"]
    totals.groups += stats["groups"]
    if run.global_step >= run.cell.timing_skip_steps:
        totals.timed_steps += 1
        totals.compute += compute
        totals.wait += wait
        # error feedback's work counts as compression here, as before Grace timed it
        # apart: the survey's compress_s (and the projection) keep their meaning
        totals.compress += stats["compress_seconds"] + stats["memory_seconds"]
        totals.communicate += stats["communicate_seconds"]
        totals.decompress += stats["decompress_seconds"]
