"""Script mode, the survey's side: for each cell, start the ranks of the user's script (itself,
or through a launcher command such as torchrun or horovodrun), stop them all when one fails,
hangs or outlives the others, and compose the cell's epoch and summary lines of results.jsonl
from the ranks' reports (the script's side: :mod:`grace_survey.script.api`)."""

from __future__ import annotations

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

from grace_dgc.errors import GraceConfigError
from grace_dgc.stats import WAIT
from grace_survey.running.conditions import Neighbours, launch_record, machine_load
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
from grace_survey.script.protocol import (
    CELL_ENV,
    DIR_ENV,
    FAILED,
    FINISHED,
    REPORT_WAIT_S,
    SCRIPT_RUNS,
    STARTED,
    report_file,
)
from grace_survey.units import shown_path

if TYPE_CHECKING:
    from grace_survey.config.cell import Cell

STRAGGLE_S = 300.0  # ranks still running this long after another finished cleanly are stopped
STANDARD = ("test_accuracy", "test_loss", "train_accuracy", "train_loss", "lr")  # a report's metrics that are columns


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
        path = report_file(directory, rank)
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
    and return the summary. Raises (with the failing rank's traceback) if it fails.

    The ranks start here (``launcher = "local"``: N processes with torchrun's environment on
    localhost) or through the command prefix that starts every rank (``horovodrun -np {workers}
    -H ...``, ``torchrun --nproc-per-node {workers}``, ``srun ... torchrun ...``); each gets the
    cell in its environment and appends its reports to ``OUT/script-runs/<run>/rank<r>.jsonl``
    (across nodes, ``--out`` must be on a filesystem every node sees). A rank that fails ends
    the cell on every rank (the others are stopped) with that rank's traceback in the results;
    a cell past the config's ``timeout`` is stopped likewise."""
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
