"""A survey run that loses a replica group and takes it back (issue 57): the cell's workers are
torchft replica groups of one rank each, one process per group beside a lighthouse, training
under :func:`grace_dgc.training.torchft.fault_tolerant`.

A fault (``faults = [{group = 1, at_step = 20, back_after_steps = 10}]`` in the TOML) kills
group ``group`` (``os._exit``, as SIGKILL would) as the job reaches step ``at_step``, between
steps or, with ``inside_exchange = true``, inside its next exchange; the others go on without
it; it is started again once the job reaches ``at_step + back_after_steps``, heals from a peer
at its first quorum and trains on. Each method also runs under torchft with no fault (the
``torchft`` runs): the report sets each faulted run beside that one, launched alike, so the time
lost and the metric lost are the fault's alone.

Every group steps by the job's step (the steps committed, ``manager.current_step()``; a schedule's
own step count, whose local steps commit once a round), so a group that heals in late reads the
batches of the step the job is at. Group 0 never dies: it
records the run (its epochs' figures, its evaluation of the whole test split after each epoch),
as rank 0 does in the other runs. A schedule (DiLoCo, local SGD) is evaluated on group 0's model
as it is at the epoch's end (no extra synchronization: a collective outside the steps would not
be under the quorum); 1-bit Adam likewise.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from grace_dgc.errors import GraceConfigError
from grace_dgc.launch import _environment, rank_environment, threads_per_rank
from grace_dgc.training.schedules import OuterSync
from grace_dgc.training.schedules.adam import AdamSchedule
from grace_survey.running.context import Context
from grace_survey.running.metrics import RankTotals, epoch_record
from grace_survey.running.results import Record, latest_summaries, read_records
from grace_survey.running.train import (
    _add_step,
    _epoch_batches,
    _peak_memory,
    _start,
    _update,
    evaluate,
    reset_peak_rss,
)

if TYPE_CHECKING:
    from grace_survey.config.cell import Cell
    from grace_survey.running.train import _Training
    from grace_survey.workloads.data import Split
    from grace_survey.workloads.registry import Workload

DIED = 9  # the exit status of a group killed by its fault
STEP_TIMEOUT_S = 10.0  # a collective with a lost group ends at this limit (or at once, when its connections close)


class FaultContext(Context):
    """A replica group's runtime: ``rank`` is the group, ``size`` the groups the run was planned
    with (each reads its own rows of every global batch, as a rank does), the Grace's engine the
    group's Manager. The runner's own collectives stay in the group (group 0 records alone): a
    lost group must not hang the bookkeeping."""

    def __init__(
        self, manager: Any, group: int, groups: int, device: torch.device, attempt: int = 0, progress_file: str = ""
    ) -> None:
        from grace_dgc.engines.torchft_engine import TorchFTEngine

        self.manager = manager
        self.engine = TorchFTEngine(manager)
        self.engine_kind, self.grace_engine = "torchft", self.engine  # every Grace on the group's Manager
        self.rank, self.size, self.device = group, groups, device
        self.attempt = attempt  # 0: started with the run; 1: started again after its fault
        self.progress_file = progress_file  # where group 0 writes the job's step, for the runner

    @property
    def backend(self) -> str:
        return "gloo"

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        return [[float(v) for v in values]]

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def train(self, *args: Any, **kwargs: Any) -> tuple[list[Record], dict[str, Any]]:
        """:func:`train_under_faults` on this group (what :func:`~grace_survey.running.execute.execute_cell` calls)."""
        return train_under_faults(self, *args, **kwargs)

    def alone(self) -> Context:
        """This group as a world of one, for evaluating the whole test split."""
        return Context("local", self.device)


def run_fault_cell(cell: Cell, out_dir: str, timeout: float, device: str) -> Record | None:
    """Train ``cell`` (its ``fault``: the torchft baseline or a fault) as a lighthouse and a
    process per replica group; returns group 0's summary line, read back from results.jsonl."""
    from torchft.coordination import LighthouseServer

    fault = cell.fault or {}
    # a group silent for 2 s is out of the quorum (long enough for a slow start on a busy machine)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    address = "http://localhost:" + lighthouse.address().rsplit(":", 1)[1]
    spawn = multiprocessing.get_context("spawn")
    scratch = tempfile.mkdtemp(prefix="grace-fault-")
    progress = os.path.join(scratch, "progress")

    def start(group: int, attempt: int) -> Any:
        process = spawn.Process(
            target=_group_main, args=(cell, out_dir, group, attempt, address, device, progress), daemon=True
        )
        with _environment(rank_environment(cell.workers)):  # the threads every launcher gives a rank
            process.start()
        return process

    groups = {g: start(g, 0) for g in range(cell.workers)}
    restarted = False
    deadline = time.monotonic() + timeout
    try:
        while groups:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cell.run_id}: replica groups {sorted(groups)} still ran after {timeout:g} s")
            for group, process in list(groups.items()):
                if process.is_alive():
                    continue
                del groups[group]
                if process.exitcode == DIED and group == fault.get("group") and not restarted:
                    # started now, it waits (imported, no Manager yet) until the job reaches its step of return:
                    # the return falls on that step however long a process takes to start here
                    groups[group], restarted = start(group, 1), True
                elif process.exitcode != 0:
                    raise RuntimeError(
                        f"{cell.run_id}: replica group {group} failed (exit {process.exitcode}); its error is "
                        "above in this log"
                    )
            time.sleep(0.05)
    finally:
        for process in groups.values():
            process.kill()
        lighthouse.shutdown()
    summaries = {r["run_id"]: r for r in latest_summaries(read_records(out_dir))}
    return summaries.get(cell.run_id)


def _read_progress(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _group_main(
    cell: Cell, out_dir: str, group: int, attempt: int, lighthouse: str, device: str, progress: str
) -> None:
    """One replica group's process: its Manager, then the cell as :func:`execute_cell` runs it."""
    from grace_dgc.training.torchft import group_manager
    from grace_survey.running.execute import execute_cell

    torch.set_num_threads(threads_per_rank(cell.workers))
    if attempt:  # the lost group: back once the job reaches at_step + back_after_steps
        back_at = cell.fault["at_step"] + cell.fault["back_after_steps"]  # type: ignore[index]
        while _read_progress(progress) < back_at and not os.path.exists(progress + ".end"):
            time.sleep(0.01)
        if os.path.exists(progress + ".end"):
            return  # the run ended first: the group stays lost
    manager = group_manager(f"group_{group}", lighthouse, timeout=STEP_TIMEOUT_S)
    ctx = FaultContext(manager, group, cell.workers, torch.device(device), attempt, progress)
    try:
        execute_cell(ctx, cell, out_dir, progress=False, launcher="torchft")
    finally:
        manager.shutdown(wait=False)


def train_under_faults(
    ctx: FaultContext, cell: Cell, workload: Workload, lr: float, *splits_and_epochs: Any, **hooks: Any
) -> tuple[list[Record], dict[str, Any]]:
    """:func:`grace_survey.running.train.train` for a replica group (its arguments: the training
    and test splits, the epochs, ``on_epoch``; a group draws no progress bar and logs no scalars):
    the steps follow the job's step count, a group behind heals at its step's quorum, the fault's
    group dies where it says."""
    train_split, eval_split, epochs = splits_and_epochs
    on_epoch: Callable[[Record], object] | None = hooks.get("on_epoch")
    from grace_dgc.training.torchft import fault_tolerant

    run, train_split = _start(ctx, cell, workload, lr, train_split, epochs, None)
    group = _Group(run, ctx, fault_tolerant(ctx.manager, run.dist_opt, run.model), cell.fault or {}, epochs)
    reset_peak_rss()
    try:
        history = group.train(_Feed(run, train_split), eval_split, on_epoch)
    finally:
        run.grace.close()
    fault = group.fault
    facts: dict[str, Any] = {
        "global_batch": run.global_batch,
        "steps_per_epoch": run.steps,
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "summary": {  # beside the cell's "fault" tag: where it struck, and what group 0 lived through
            **{
                f"fault_{k}": fault[k]
                for k in ("group", "at_step", "back_after_steps", "inside_exchange")
                if k in fault
            },
            "discarded_steps": group.quorum.discarded,
            "groups_at_end": ctx.manager.num_participants(),  # all of them: the lost group came back
        },
    }
    return history, facts


class _Group:
    """One replica group's run: its steps by the job's step, its death where the fault says, and
    (group 0) the epochs' records."""

    def __init__(self, run: _Training, ctx: FaultContext, quorum: Any, fault: dict[str, Any], epochs: int) -> None:
        self.run, self.ctx, self.quorum, self.fault = run, ctx, quorum, fault
        self.total = epochs * run.steps
        if fault.get("group") is not None and fault["at_step"] + fault["back_after_steps"] >= self.total:
            raise GraceConfigError(
                f"{run.cell.run_id}: the fault brings group {fault['group']} back at step "
                f"{fault['at_step'] + fault['back_after_steps']}, but the run has {self.total} steps "
                f"({epochs} epochs of {run.steps}); lower at_step or back_after_steps"
            )
        self.dies = fault.get("group") == ctx.rank and ctx.attempt == 0
        # a schedule counts its own steps: the local steps of a round commit once, at its end
        self.schedule = isinstance(run.dist_opt, (OuterSync, AdamSchedule))
        self.history: list[Record] = []

    def job_step(self) -> int:
        """The job's step: the steps committed (a schedule's own count)."""
        return int(self.run.dist_opt.steps) if self.schedule else int(self.ctx.manager.current_step())  # type: ignore[union-attr]

    def train(self, feed: _Feed, eval_split: Split, on_epoch: Callable[[Record], object] | None) -> list[Record]:
        run, ctx = self.run, self.ctx
        totals, epoch, taken, epoch_start, first = RankTotals(), -1, 0, time.perf_counter(), True
        while self.job_step() < self.total:
            self._die_where_the_fault_says()
            run.dist_opt.zero_grad()  # the quorum: a group behind the others heals here
            step = self.job_step()
            if first and ctx.attempt and not self.quorum.healed:
                break  # started again after the others ended: nobody to heal from, nothing to join
            first = False
            if step >= self.total:
                break
            if step // run.steps != epoch:
                if epoch >= 0:
                    self._close_epoch(epoch, taken, totals, epoch_start, eval_split, on_epoch)
                epoch, taken, totals, epoch_start = step // run.steps, 0, RankTotals(), time.perf_counter()
                run.grace.set_epoch(epoch)
            run.global_step = step
            _one_step(run, epoch, feed, step % run.steps, totals)
            taken += 1
            self._tell_the_runner(str(self.job_step()))
        self._tell_the_runner(None)
        if epoch >= 0:
            self._close_epoch(epoch, taken, totals, epoch_start, eval_split, on_epoch)
        return self.history

    def _die_where_the_fault_says(self) -> None:
        if not (self.dies and self.job_step() >= self.fault["at_step"]):
            return
        if not self.fault.get("inside_exchange"):
            os._exit(DIED)
        for collective in ("allreduce", "allgather", "all_to_all", "broadcast"):  # the next exchange ends it
            setattr(self.ctx.engine, collective, lambda *a, **k: os._exit(DIED))

    def _tell_the_runner(self, step: str | None) -> None:
        """Group 0 writes the job's step for the runner (None: the run ended, a group still due stays out)."""
        if self.ctx.rank != 0:
            return
        path = self.ctx.progress_file
        if step is None:
            open(path + ".end", "w").close()
            return
        with open(path + ".tmp", "w") as f:
            f.write(step)
        os.replace(path + ".tmp", path)

    def _close_epoch(
        self,
        epoch: int,
        steps: int,
        totals: RankTotals,
        started: float,
        eval_split: Split,
        on_epoch: Callable[[Record], object] | None,
    ) -> None:
        """Group 0's record of ``epoch`` (``steps`` taken, discarded ones included): its own
        totals, and its model evaluated on the whole test split."""
        if self.ctx.rank != 0:
            return
        run = self.run
        totals.train_time = time.perf_counter() - started
        totals.peak_rss_mb, totals.peak_gpu_mb = _peak_memory(self.ctx)
        test_loss, test_acc = evaluate(self.ctx.alone(), run.model, eval_split, run.cell.eval_batch_size, run.workload)
        elapsed = self.history[-1]["elapsed_s"] if self.history else 0.0
        self.history.append(
            epoch_record(
                [totals],
                epoch + 1,
                run.lr_now(epoch),
                max(steps, 1),
                run.global_batch,
                elapsed,
                test_loss,
                test_acc,
                {},
            )
        )
        if on_epoch is not None:
            on_epoch(self.history[-1])


class _Feed:
    """A group's batches by the job's step (:func:`grace_survey.running.train._epoch_batches`),
    read from any step on: a group that heals in late starts mid-epoch, a discarded step is read again."""

    def __init__(self, run: _Training, split: Split) -> None:
        self.run, self.split = run, split
        self.epoch, self.next_index = -1, -1
        self.loader: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(())
        self.augment_rng = torch.Generator()

    def batch(self, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        run = self.run
        if (epoch, index) != (self.epoch, self.next_index):
            self.loader, self.augment_rng = _epoch_batches(run, epoch, self.split, first=index)
        self.epoch, self.next_index = epoch, index + 1
        x, y = next(self.loader)
        if run.workload.augment is not None:
            x = run.workload.augment(x, self.augment_rng)
        return x.to(run.ctx.device), y.to(run.ctx.device)


def _one_step(run: _Training, epoch: int, feed: _Feed, index: int, totals: RankTotals) -> None:
    """One measured step (its quorum already formed), added to ``totals``."""
    for group in run.optimizer.param_groups:
        group["lr"] = run.lr_now(epoch)
    x, y = feed.batch(epoch, index)
    run.model.train()
    t0 = time.perf_counter()
    loss, hits, count = run.score(run.model(x), y)
    loss.backward()
    t1 = time.perf_counter()
    _update(run)
    t2 = time.perf_counter()
    stats = run.measured.stats()
    run.measured.reset_stats()
    _add_step(run, totals, stats, loss.item() * count, hits.item(), count, t1 - t0, t2 - t1)
