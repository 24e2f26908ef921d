"""Script mode: the survey runs *your* training script once per cell.

    grace-dgc survey --script train.py --config methods.toml --out runs/mine [--script-args ...]

The script is an ordinary torchrun-style script. It asks for the cell's method with one
call and reports its metrics with one call per epoch; grace's own counters (bytes, ratio,
compress / communicate / decompress / wait time) are collected without it doing anything::

    import grace_dgc, grace_survey as survey
    dist.init_process_group(...)                           # as under torchrun
    torch.manual_seed(survey.cell_seed())                  # the cell's seed (0 when run alone)
    grace = survey.cell_grace("none")                      # the cell's method; the arguments are
    opt = grace_dgc.DistributedOptimizer(sgd, grace, ...)  #   what a plain `torchrun` run uses
    for epoch in range(epochs):
        ...train, evaluate...
        survey.report_metrics(epoch=epoch + 1, accuracy=acc, loss=test_loss, train_loss=tl, samples=n)

Run alone (no survey), the same script trains with the fallback method and ``report_metrics`` is a
no-op, so one script serves both.

What the survey measures (per rank, between consecutive ``report_metrics`` calls):
  * the wall time (evaluation included, unless the script passes ``train_time_s``); the
    clock starts when ``cell_grace`` is called;
  * grace's counters and timers since the previous report (``Grace.stats()`` deltas: the
    script may read and reset nothing);
  * the rank's peak memory.
Rank 0's metrics are the run's; every rank's bytes and times are averaged as the built-in
workloads' are. ``samples`` (examples this rank trained on since the last report) gives
samples/s; without it the throughput column is empty.

The survey's side, which starts the ranks, supervises them and composes the results lines
from their reports, is :mod:`grace_survey.script.supervisor`; what both sides agree on (the
environment, the files) is :mod:`grace_survey.script.protocol`.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.stats import COUNTERS, TIMERS, WAIT
from grace_survey.script.protocol import (
    CELL_ENV,
    DIR_ENV,
    FAILED,
    FINISHED,
    REPORT_WAIT_S,
    STARTED,
    report_file,
)

if TYPE_CHECKING:
    from grace_dgc.grace import Grace

RENAMED = {"accuracy": "test_accuracy", "loss": "test_loss"}  # report_metrics()'s names -> the records' names
MEASURED = (*COUNTERS, *(f"{timer}_seconds" for timer in TIMERS), WAIT, "steps")


class _Session:
    """What this rank of a script-mode cell keeps between calls."""

    def __init__(self, cell: Mapping[str, Any], directory: str, rank: int) -> None:
        self.cell, self.directory, self.rank = cell, directory, rank
        self.grace: Grace | None = None
        self.started = self.last = time.perf_counter()
        self.elapsed = 0.0
        self.previous: dict[str, float] = dict.fromkeys(MEASURED, 0.0)
        self.history: list[int] = []  # the epochs reported


_session: _Session | None = None


def cell() -> dict[str, Any] | None:
    """The running cell's settings (label, method, seed, workers, the config's ``hyper``
    overrides such as epochs, lr, batch_size), or None when the script runs alone."""
    raw = os.environ.get(CELL_ENV)
    return None if raw is None else json.loads(raw)


def cell_seed(default: int = 0) -> int:
    """The cell's seed (model init and data order are the script's: seed them from this so
    every method starts from the same weights); ``default`` when run alone."""
    settings = cell()
    return default if settings is None else int(settings["seed"])


def _world_size() -> int:
    """The whole world's rank count (a process group's subgroup aside)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        import horovod.torch as hvd

        return int(hvd.rank())
    except (ImportError, ValueError):
        return int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")))


def cell_grace(
    compressor: str = "none",
    memory: str = "none",
    communicator: str = "allreduce",
    process_group: Any = None,
    **params: Any,
) -> Grace:
    """The cell's method as a :class:`~grace_dgc.Grace` (built on the engine the script
    initialised: torch.distributed or Horovod). Run alone, the arguments are the method
    (``grace_dgc.build(compressor, memory, communicator, **params)``). Call it once, after
    initialising the process group and before training: the survey's clock starts here.
    ``process_group`` (alone and in a cell) puts the Grace on a subgroup, e.g. the replicate
    dimension of an HSDP mesh; the cell's rank count is then checked against the whole world."""
    global _session
    settings = cell()
    if settings is None:
        return grace_dgc.build(compressor, memory, communicator, process_group=process_group, **params)
    method = settings["method"]
    params = dict(method["params"])
    if process_group is not None:
        params["process_group"] = process_group
    from grace_dgc.registry import COMPRESSORS

    if "seed" in COMPRESSORS.accepted_params(method["compressor"]) and "seed" not in params:
        params["seed"] = settings["seed"]  # a stochastic method's randomness follows the run seed, as built-in
    grace = grace_dgc.build(method["compressor"], method["memory"], method["communicator"], **params)
    world = grace.world_size if process_group is None else _world_size()
    if world != settings["workers"]:
        raise GraceConfigError(
            f"the cell {settings['run_id']!r} wants {settings['workers']} ranks but the script's process group has "
            f"{world}: initialise the process group from the launcher's environment (RANK, WORLD_SIZE)"
        )
    rank = _rank()
    _session = _Session(settings, os.environ[DIR_ENV], rank)
    _session.grace = grace
    with open(os.path.join(_session.directory, f"{STARTED}{rank}"), "w") as f:
        f.write(str(os.getpid()))
    _record_failures(_session.directory, rank)
    from grace_survey.running.train import reset_peak_rss

    reset_peak_rss()
    return grace


def _record_failures(directory: str, rank: int) -> None:
    """Chain an excepthook that writes ``failed<rank>`` (time and traceback): the survey then
    names the rank that failed first, not the peers that died of losing it. At a normal exit
    without one, ``finished<rank>``: a signal after that is the interpreter's teardown, not the
    script (see :func:`_wait`): torch's gloo teardown aborts so ("terminate called without an
    active exception") when a gloo worker frees a finished collective's tensors while the
    interpreter shuts down (docs/survey.md, "Your own script")."""
    previous = sys.excepthook
    raised: list[type[BaseException]] = []

    def finished() -> None:
        if not raised:
            try:
                with open(os.path.join(directory, f"{FINISHED}{rank}"), "w") as f:
                    f.write(str(time.time()))
            except OSError:
                pass

    atexit.register(finished)

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        import traceback

        raised.append(kind)
        try:
            with open(os.path.join(directory, f"{FAILED}{rank}"), "w") as f:
                text = "".join(traceback.format_exception(kind, error, tb))
                json.dump({"rank": rank, "time": time.time(), "traceback": text}, f)
        except OSError:
            pass
        previous(kind, error, tb)

    sys.excepthook = hook


def _number(key: str, value: object) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().cpu().reshape(()).item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise GraceConfigError(
        f"report_metrics({key}=...) got {type(value).__name__} {value!r:.60}; a metric is a number "
        "(int, float or a one-element tensor)"
    )


def report_metrics(epoch: int | None = None, *, train_time_s: float | None = None, **metrics: Any) -> None:
    """Record this epoch's metrics (call it on every rank, once per epoch, after the epoch;
    ``epoch`` counts the epochs done, from 1). It also tells grace the next epoch
    (``grace.set_epoch(epoch)``), so schedule-driven methods such as DGC's warm-up advance.

    ``accuracy`` and ``loss`` are the test metric and loss the report ranks and tests (the
    target of time-to-target is on ``accuracy``); ``train_loss``, ``train_accuracy``, ``lr``
    and ``samples`` (examples this rank trained on since the last call) are read too; any
    other name is kept as it is. Values are numbers. ``train_time_s`` replaces the measured
    wall time since the last call (e.g. to leave evaluation out). A no-op when run alone."""
    if cell() is None:
        return
    session = _session
    if session is None or session.grace is None:
        raise GraceConfigError("survey.report_metrics() before survey.cell_grace(): ask for the cell's method first")
    values = {RENAMED.get(key, key): _number(key, value) for key, value in metrics.items()}
    if not session.history:
        _every_rank_reports(session)
    done = len(session.history) + 1 if epoch is None else int(epoch)
    session.history.append(done)
    now = time.perf_counter()
    wall = now - session.last if train_time_s is None else _number("train_time_s", train_time_s)
    session.last = now
    session.elapsed += wall
    stats = session.grace.stats()
    measured = {key: float(stats.get(key, 0.0)) - session.previous[key] for key in MEASURED}
    session.previous = {key: float(stats.get(key, 0.0)) for key in MEASURED}
    from grace_survey.running.train import peak_rss_mb

    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    line = {
        "epoch": None if epoch is None else int(epoch),
        "metrics": values,
        "wall_s": wall,
        "elapsed_s": session.elapsed,
        "measured": measured,
        "method_stats": {k: v for k, v in stats.items() if k not in MEASURED and _plain(v)},
        "peak_rss_mb": peak_rss_mb(),
        "peak_gpu_mb": gpu,
        "timed_by_script": train_time_s is not None,
        "backend": session.grace.engine.backend,
        "engine": session.grace.engine.name,
    }
    if len(session.history) == 1:  # the rank's threads, as its launcher started it
        from grace_survey.running.conditions import conditions

        line["conditions"] = conditions()
    with open(report_file(session.directory, session.rank), "a") as f:
        f.write(json.dumps(line) + "\n")
    session.grace.set_epoch(done)  # the next epoch, 0-based, is the number of epochs done


def _every_rank_reports(session: _Session) -> None:
    """At the first report: every rank must make it (the survey averages every rank's bytes and
    times, and a rank without reports fails the cell only once training is over). The ranks
    meet in torch.distributed's store, not in a collective, so that a rank that never comes
    leaves the others an error naming it instead of a collective out of step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # Horovod: no store to meet in; the count check after the run still names the rank
    import datetime as dt

    store = dist.distributed_c10d._get_default_store()
    workers, key = int(session.cell["workers"]), f"grace/report_metrics/{session.directory}/"
    store.set(f"{key}{session.rank}", "1")
    wait = float(session.cell.get("report_wait_s", REPORT_WAIT_S))
    try:
        store.wait([f"{key}{r}" for r in range(workers)], dt.timedelta(seconds=wait))
    except Exception as error:
        if "timeout" not in str(error).lower():
            raise
        missing = [r for r in range(workers) if not store.check([f"{key}{r}"])]
        raise GraceConfigError(
            f"report_metrics() was called on rank {session.rank} but not on rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))} within {wait:g} s: every rank must call it, once per epoch (the "
            "survey averages every rank's bytes and times); call it outside any `if rank == 0:`"
        ) from None


def _plain(value: object) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
