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

How a cell runs (the parent side, :func:`run_script_cell`): the survey starts the ranks —
itself (``launcher = "local"``: N processes with torchrun's environment on localhost) or
through a command prefix that starts every rank (``horovodrun -np {workers} -H ...``,
``torchrun --nproc-per-node {workers}``, ``srun ... torchrun ...``) — and hands each the
cell in the environment (``GRACE_DGC_CELL``). Each rank appends its reports to
``OUT/script-runs/<run>/rank<r>.jsonl``; the survey composes the epoch lines and the
summary line of ``results.jsonl`` from them, so the report, the statistics and
``grace-dgc project`` read script results as they read any other. A rank that fails ends the
cell on every rank (the others are stopped) with that rank's traceback in the results; a
cell past the config's ``timeout`` is stopped likewise. Across nodes, ``--out`` must be on a
filesystem every node sees.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.launch import Neighbours, launch_record, machine_load
from grace_dgc.stats import COUNTERS, TIMERS, WAIT
from grace_survey.running.results import Record, append_record
from grace_survey.running.summary import (
    COMPUTE_S,
    EXCHANGE_TIMERS,
    STEP_S,
    WAIT_S,
    SummaryParts,
    byte_totals,
    mean_step_times,
    summary_record,
)
from grace_survey.units import shown_path

if TYPE_CHECKING:
    from grace_dgc.grace import Grace
    from grace_survey.config.cell import Cell

CELL_ENV = "GRACE_DGC_CELL"  # the cell, as JSON
DIR_ENV = "GRACE_DGC_CELL_DIR"  # where the ranks write their reports
SCRIPT_RUNS = "script-runs"
STARTED = "started"  # the marker cell_grace writes: the script asked for its method
FAILED = "failed"  # failed<rank>: the time and traceback of a rank's uncaught exception
FINISHED = "finished"  # finished<rank>: the rank's script ended without an uncaught exception
STRAGGLE_S = 300.0  # ranks still running this long after another finished cleanly are stopped
RENAMED = {"accuracy": "test_accuracy", "loss": "test_loss"}  # report_metrics()'s names -> the records' names
STANDARD = ("test_accuracy", "test_loss", "train_accuracy", "train_loss", "lr")
MEASURED = (*COUNTERS, *(f"{timer}_seconds" for timer in TIMERS), WAIT, "steps")


# =============================================================== the script's side (each rank)
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
REPORT_WAIT_S = 300.0  # the longest a rank waits at its first report for the others (see _every_rank_reports)


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
        from grace_dgc.launch import conditions

        line["conditions"] = conditions()
    with open(os.path.join(session.directory, f"rank{session.rank}.jsonl"), "a") as f:
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


# ================================================================ the survey's side (parent)
def check_launcher(launcher: object) -> str:
    """``local`` or a command prefix (with ``{workers}`` / ``{port}`` placeholders)."""
    if not isinstance(launcher, str) or not launcher.strip():
        raise GraceConfigError(f"launcher = {launcher!r}: give 'local' or a command prefix such as 'horovodrun ...'")
    if launcher == "local":
        return launcher
    try:
        words = shlex.split(launcher.format(workers=2, port=29500))
    except (ValueError, KeyError, IndexError) as err:
        raise GraceConfigError(
            f"launcher = {launcher!r} is not a command line ({err}); placeholders: {{workers}}, {{port}}"
        ) from None
    if shutil.which(words[0]) is None:
        raise GraceConfigError(f"launcher = {launcher!r}: {words[0]!r} is not on PATH")
    return launcher


def _command(cell: Cell, port: int) -> list[str]:
    script = [cell.script or "", *cell.script_args]
    if cell.launcher == "local":
        return [sys.executable, *script]
    prefix = shlex.split(cell.launcher.format(workers=cell.workers, port=port))
    # torchrun (anywhere in the prefix: `srun ... torchrun ...`) takes the script itself; other launchers a program
    if any(os.path.basename(word).startswith("torchrun") or word == "torch.distributed.run" for word in prefix):
        return [*prefix, *script]
    return [*prefix, sys.executable, *script]


def _run_dir(out_dir: str, cell: Cell, attempt: str) -> str:
    name = re.sub(r"[^\w.@-]+", "_", cell.run_id) + "-" + attempt
    path = os.path.abspath(os.path.join(out_dir, SCRIPT_RUNS, name))  # the ranks run in the user's folder
    os.makedirs(path, exist_ok=True)
    return path


def _start(
    cell: Cell, directory: str, backend: str, device: str, timeout: float = REPORT_WAIT_S
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """The cell's processes: one per rank (local) or the launcher's one, each logging to a file."""
    from grace_dgc.launch import free_port, rank_environment

    port = free_port()
    env = dict(os.environ)
    settings = dict(cell.as_dict(), report_wait_s=min(timeout / 2, REPORT_WAIT_S))  # before the cell times out
    env.update({CELL_ENV: json.dumps(settings, default=str), DIR_ENV: directory})
    env.update(GRACE_DGC_BACKEND=backend, GRACE_DGC_DEVICE=device, PYTHONUNBUFFERED="1")
    command = _command(cell, port)

    def start(log_name: str, process_env: dict[str, str]) -> subprocess.Popen[bytes]:
        # its own session: stopping the cell reaches the launcher's ranks and DataLoader workers too
        with open(os.path.join(directory, log_name), "wb") as log:
            return subprocess.Popen(
                command, env=process_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    # every launcher's ranks get the same threads (torchrun keeps an OMP_NUM_THREADS it is given,
    # horovodrun passes the environment on): the rule of grace_dgc.launch, as the survey's own ranks
    env.update(rank_environment(cell.workers))
    if cell.launcher != "local":
        return [("launcher", start("launcher.log", env))]
    procs = []
    for rank in range(cell.workers):
        rank_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
        rank_env.update(WORLD_SIZE=str(cell.workers), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cell.workers))
        procs.append((f"rank {rank}", start(f"rank{rank}.log", rank_env)))
    return procs


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    """``sig`` to ``proc``'s whole process group (it leads one: ``start_new_session``)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """SIGTERM to each of the cell's processes (a launcher then stops its ranks, remote ones
    too), then, 5 s later, SIGKILL to their whole process groups (stragglers, loader workers)."""
    for _, proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for _, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal(proc, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): reported by the caller, not waited on
            pass


def _traceback(directory: str, who: str) -> str:
    """The last traceback in ``who``'s log (else the log's tail)."""
    name = "launcher.log" if who == "launcher" else f"rank{who.split()[-1]}.log"
    try:
        with open(os.path.join(directory, name), errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    start = text.rfind("Traceback (most recent call last)")
    return (text[start:] if start >= 0 else text[-3000:]).strip()[-4000:] or "(the log is empty)"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def _first_failure(directory: str) -> tuple[str, str] | None:
    """(rank, traceback) of the earliest exception the ranks' excepthook recorded, if any: the
    cause, where the others died of a lost peer (a launcher's one log interleaves them all)."""
    found = []
    for name in os.listdir(directory):
        if name.startswith(FAILED):
            try:
                with open(os.path.join(directory, name)) as f:
                    found.append(json.load(f))
            except (OSError, ValueError):
                continue
    if not found:
        return None
    first = min(found, key=lambda entry: entry["time"])
    return f"rank {first['rank']}", first["traceback"]


def _wait(
    procs: list[tuple[str, subprocess.Popen[bytes]]],
    directory: str,
    timeout: float,
    run_id: str,
    straggle: float,
    workers: int,
) -> None:
    """Wait for the cell's processes; the first failure, the timeout, or ranks still running
    ``straggle`` seconds after another rank finished cleanly (blocked on a peer that left) stop
    all of them."""
    deadline = time.monotonic() + timeout
    first_done: float | None = None
    excused: set[str] = set()
    while True:
        for who, proc in procs:
            if who not in excused and _after_its_script(directory, who, proc.poll(), workers):
                excused.add(who)
                print(
                    f"[survey] {run_id}: {who} exited with status {proc.returncode} after its script had finished "
                    f"(in the interpreter's teardown: {_last_line(_traceback(directory, who))}); its reports are kept",
                    file=sys.stderr,
                )
        failed = [(who, proc.returncode) for who, proc in procs if proc.poll() not in (None, 0) and who not in excused]
        if failed:
            grace_period = time.monotonic() + 2  # the others' errors (a peer gone) come second
            while time.monotonic() < grace_period and any(p.poll() is None for _, p in procs):
                time.sleep(0.05)
            _stop(procs)
            who, code = failed[0]
            output = _traceback(directory, who)
            recorded = _first_failure(directory)
            if recorded is not None:  # the excepthook's clock beats the order of the polls
                who, output = recorded
            later = [f"{w} ({_last_line(_traceback(directory, w))})" for w, p in procs if w != who and p.returncode]
            raise RuntimeError(
                f"{run_id}: {who} of the script failed first (exit status {code}); the cell was stopped on every "
                f"rank{'; then ' + ', '.join(later) if later else ''}. {who}'s traceback:\n{output[-3000:]}"
            )
        done = [proc.poll() == 0 or who in excused for who, proc in procs]
        if all(done):
            return
        if any(done) and first_done is None:
            first_done = time.monotonic()
        if first_done is not None and time.monotonic() - first_done > straggle:
            _stop(procs)
            waiting = [who for (who, _), ok in zip(procs, done) if not ok]
            raise TimeoutError(
                f"{run_id}: {', '.join(waiting)} still running {straggle:g} s after another rank finished: blocked on "
                "a peer that left (every rank must run the same collectives); the cell was stopped"
            )
        if time.monotonic() > deadline:
            _stop(procs)
            alive = [who for who, proc in procs if proc.returncode not in (0,)]
            raise TimeoutError(f"{run_id}: the script did not finish within timeout = {timeout:g} s ({alive} stopped)")
        time.sleep(0.05)


def _after_its_script(directory: str, who: str, code: int | None, workers: int) -> bool:
    """Did ``who`` end badly only after the script had ended without an exception? A rank:
    killed by a signal after ``finished<rank>`` (and no ``failed<rank>``). A launcher
    (torchrun reports a rank's signal as its own exit status 1): every rank of the cell
    finished and none failed. Then the script's work and reports are whole."""
    if code is None or code == 0:
        return False
    if who == "launcher":
        ranks = [str(rank) for rank in range(workers)]
    elif who.startswith("rank ") and code < 0:
        ranks = [who.split()[-1]]
    else:
        return False
    return all(
        os.path.exists(os.path.join(directory, f"{FINISHED}{rank}"))
        and not os.path.exists(os.path.join(directory, f"{FAILED}{rank}"))
        for rank in ranks
    )


def _read_reports(directory: str, workers: int, run_id: str) -> dict[int, list[dict[str, Any]]]:
    """Every rank's report lines; a rank without reports, or with another number of them, is an
    error naming it (its figures would silently drop out of the averages)."""
    reports: dict[int, list[dict[str, Any]]] = {}
    for rank in range(workers):
        path = os.path.join(directory, f"rank{rank}.jsonl")
        if os.path.isfile(path):
            with open(path) as f:
                reports[rank] = [json.loads(line) for line in f if line.strip()]
    if not reports.get(0):
        raise GraceConfigError(
            f"{run_id}: the script finished without reporting a metric: call "
            "grace_survey.report_metrics(epoch=..., accuracy=..., loss=...) on every rank once per epoch"
        )
    counts = {rank: len(reports.get(rank, [])) for rank in range(workers)}
    if len(set(counts.values())) > 1:
        odd = ", ".join(f"rank {r}: {n}" for r, n in counts.items() if n != counts[0])
        raise GraceConfigError(
            f"{run_id}: every rank must call report_metrics() as often as rank 0 ({counts[0]} times); {odd} "
            f"(reports in {directory}; across nodes, --out must be on a filesystem every node sees)"
        )
    return reports


def run_script_cell(cell: Cell, out_dir: str, timeout: float, backend: str, device: str) -> Record:
    """Run ``cell``'s script on its ranks; append its epoch lines and summary to results.jsonl
    and return the summary. Raises (with the failing rank's traceback) if it fails."""
    attempt = os.urandom(6).hex()
    directory = _run_dir(out_dir, cell, attempt)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    at_start, neighbours, own_cpu = machine_load(), Neighbours(), _cpu_of_children()
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        procs = _start(cell, directory, backend, device, timeout)
        _wait(procs, directory, timeout, cell.run_id, straggle=min(timeout, STRAGGLE_S), workers=cell.workers)
    finally:
        _stop(procs)  # after a success too: nothing the script started outlives its cell
    asked = [name for name in os.listdir(directory) if name.startswith(STARTED)]
    if not asked:
        raise GraceConfigError(
            f"{cell.run_id}: the script {cell.script} finished without asking for its method: call "
            "grace_survey.cell_grace() after initialising the process group, and train with that Grace "
            f"(its output: {os.path.join(directory, '*.log')})"
        )
    reports = _read_reports(directory, cell.workers, cell.run_id)
    summary = compose(cell, reports, attempt, started, backend, device)
    ranks = [reports[r][0].get("conditions", {}) for r in sorted(reports)]
    others = neighbours.share(_cpu_of_children() - own_cpu)
    summary["launch"] = launch_record("script " + cell.launcher, ranks, at_start, others)
    epochs = summary.pop("_epochs")
    for record in epochs:
        append_record(out_dir, record)
    _tensorboard(cell, epochs)
    append_record(out_dir, summary)
    return summary


def _cpu_of_children() -> float:
    """CPU seconds of this process and its waited-for descendants (the cell's ranks, a
    launcher and the ranks it waited for)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def compose(
    cell: Cell, reports: Mapping[int, list[dict[str, Any]]], attempt: str, started: str, backend: str, device: str
) -> Record:
    """The epoch records and the summary of a script-mode run, from every rank's reports:
    rank 0's metrics, bytes and times averaged over ranks, wall time the slowest rank's."""
    base: Record = cell.record_head(attempt)
    ranks = [reports[r] for r in sorted(reports)]
    epochs: list[Record] = []
    for i, line in enumerate(reports[0]):
        peers = [r[i] for r in ranks]  # the same report on each rank (equal counts: checked)
        epochs.append(dict(base, type="epoch", **_epoch(i, line, peers)))
    return dict(_summary(cell, base, epochs, started, backend, device), _epochs=epochs)


def _epoch(i: int, line: Mapping[str, Any], peers: list[dict[str, Any]]) -> Record:
    """The epoch record of rank 0's report ``line`` (the run's ``i``-th) and every rank's same report."""
    steps = max(1.0, line["measured"]["steps"])
    sent = _mean([p["measured"]["bytes_sent"] for p in peers])
    dense = _mean([p["measured"]["dense_bytes"] for p in peers])
    wall = max(p["wall_s"] for p in peers)
    samples = [p["metrics"]["samples"] for p in peers if "samples" in p["metrics"]]
    metrics = dict(line["metrics"])
    record: Record = {
        "epoch": line["epoch"] if line["epoch"] is not None else i + 1,
        "lr": metrics.pop("lr", None),
        "steps": int(line["measured"]["steps"]),
        **{key: metrics.pop(key, None) for key in STANDARD if key != "lr"},
        "epoch_time_s": wall,
        "elapsed_s": max(p["elapsed_s"] for p in peers),
        "samples_per_s": sum(samples) / wall if len(samples) == len(peers) and wall > 0 else None,
        "bytes_per_step": sent / steps,
        "dense_bytes_per_step": dense / steps,
        "compression_ratio": sent / dense if dense else 0.0,
        "exchanges_per_step": line["measured"]["tensors"] / steps,
        "groups_per_step": line["measured"]["groups"] / steps,
        "timed_steps": int(line["measured"]["steps"]),
        "peak_rss_mb": max(p["peak_rss_mb"] for p in peers),
        "peak_gpu_mb": max(p["peak_gpu_mb"] for p in peers),
        "method_stats": line["method_stats"],
        "metrics": {k: v for k, v in metrics.items() if k != "samples"},
        "timed_by_script": all(p.get("timed_by_script") for p in peers),
        "backend": line.get("backend"),
        "engine": line.get("engine", "torch"),
    }
    for key, parts in {**EXCHANGE_TIMERS, WAIT_S: (WAIT,)}.items():  # grace's timers, means over ranks
        record[key] = _mean([sum(p["measured"][part] for part in parts) for p in peers]) / steps
    record[STEP_S] = wall / steps
    record[COMPUTE_S] = max(0.0, record[STEP_S] - record[WAIT_S])  # forward, backward, data, optimizer
    return record


def _summary(cell: Cell, base: Record, epochs: list[Record], started: str, backend: str, device: str) -> Record:
    """The run's summary line (:func:`~grace_survey.running.summary.summary_record`) from its
    epoch records: sizes and samples/s from the samples the script reported, if every report did."""
    steps = sum(e["steps"] for e in epochs) or 1
    last = epochs[-1]
    sent, dense = byte_totals(epochs)
    train_time = last["elapsed_s"]
    samples = [e["samples_per_s"] * e["epoch_time_s"] for e in epochs if e["samples_per_s"] is not None]
    counted = sum(samples) if len(samples) == len(epochs) else None  # every report gave its samples
    parts = SummaryParts(
        setup=_setup(cell, last, counted, steps),
        steps_per_epoch=round(steps / len(epochs)),
        target_accuracy=cell.hyper.get("target_accuracy"),
        samples_per_s=counted / train_time if counted is not None and train_time > 0 else None,
        compression_ratio=sent / dense if dense else 0.0,
        device=device,
        backend=last["backend"] or backend,
        engine=last["engine"],
        started=started,
        step_times=mean_step_times(epochs, [e["steps"] for e in epochs]),
        timing=(
            "the script's train_time_s"
            if all(e["timed_by_script"] for e in epochs)
            else "wall time between reports (the script's evaluation and data loading included)"
        ),
        metrics=last["metrics"],
    )
    return summary_record(base, cell, epochs, parts)


def _setup(cell: Cell, last: Record, samples: float | None, steps: int) -> Record:
    """What ran, as the summary line says it: the script, its size (``samples``: the run's
    samples, if every report gave them), its last lr; the training settings are the script's."""
    return {
        "workload": cell.workload,
        "workload_description": f"script {shown_path(cell.script)} {' '.join(cell.script_args)}".strip(),
        "metric": "accuracy",
        "loss": "script",
        "script": shown_path(cell.script),
        "script_args": cell.script_args,
        "script_sha": cell.script_sha,
        "parameters": round(last["dense_bytes_per_step"] / 4),  # fp32 gradient elements exchanged per step
        "batch_size": round(samples / steps / cell.workers) if samples is not None else None,
        "global_batch": round(samples / steps) if samples is not None else None,
        "lr": last["lr"],
        "lr_tuning": None,
        "momentum": None,
        "weight_decay": None,
    }


def _tensorboard(cell: Cell, epochs: list[Record]) -> None:
    """The per-epoch scalars a built-in run logs, from the script's reports (``tensorboard = true``)."""
    if not cell.tensorboard_dir:
        return
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(os.path.join(cell.tensorboard_dir, re.sub(r"[^\w.@-]+", "_", cell.run_id)))
    step = 0
    try:
        for record in epochs:
            step += record["steps"]
            for tag, key in (
                ("epoch/test_accuracy", "test_accuracy"),
                ("epoch/test_loss", "test_loss"),
                ("epoch/train_loss", "train_loss"),
                ("epoch/bytes_per_step", "bytes_per_step"),
            ):
                if record.get(key) is not None:
                    writer.add_scalar(tag, record[key], step)
            for name, value in record["metrics"].items():
                writer.add_scalar(f"epoch/{name}", value, step)
    finally:
        writer.close()
