"""The grid driver: every unfinished cell of a config, each in its own process group on this
machine (:func:`grace_dgc.launch.run_local`), shaped networks in a network namespace."""

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from grace_dgc.errors import GraceConfigError
from grace_dgc.launch import RankPool, run_local
from grace_survey.config.cell import Cell
from grace_survey.extras import require
from grace_survey.running import netem
from grace_survey.running.execute import run_cell
from grace_survey.running.rerun import earlier_cells, plan_lines, remove_stale_outputs
from grace_survey.running.results import (
    CONFIG_JSON,
    Record,
    append_record,
    finished_runs,
    latest_summaries,
    read_records,
    write_grid,
    write_summary_csv,
)
from grace_survey.running.train import load_workload
from grace_survey.script.supervisor import run_script_cell
from grace_survey.workloads.data import size

if TYPE_CHECKING:
    from grace_survey.config.settings import SurveyConfig
    from grace_survey.workloads.registry import Workload


def resolve_runtime(config: "SurveyConfig", workers: int = 1, network_shaped: bool = False) -> tuple[str, str]:
    """(backend, device) for local launches. ``auto``: NCCL + CUDA when there is a GPU per
    rank (gloo when the network is shaped: NCCL would bypass the loopback), else gloo on
    CPU; ``device = "cuda"`` with gloo puts every rank on the GPUs it finds (shared)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.device == "cuda" and not gpus:
        raise GraceConfigError("device = 'cuda' but torch sees no GPU; use device = 'auto' or 'cpu'")
    if config.device == "auto":
        cuda = gpus >= workers
    else:
        cuda = config.device == "cuda"
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if cuda and gpus >= workers and not network_shaped else "gloo"
    if backend == "nccl" and gpus < workers:
        raise GraceConfigError(
            f"backend = 'nccl' needs a GPU per rank ({workers} ranks, {gpus} GPUs); use backend = 'gloo'"
        )
    return backend, "cuda" if cuda else "cpu"


def prepare(config: "SurveyConfig", out_dir: str, check_workload: bool = True) -> tuple[list[Cell], "Workload | None"]:
    """Create ``out_dir``, save the resolved config and load the workload once (checks its
    options and files before any rank starts; generated data is cached for the ranks)."""
    os.makedirs(out_dir, exist_ok=True)
    raw = config.to_dict()
    raw["name"] = config.name
    with open(os.path.join(out_dir, CONFIG_JSON), "w") as f:
        json.dump(raw, f, indent=2, default=str)
    cache_dir = os.path.join(out_dir, "data-cache")
    os.makedirs(cache_dir, exist_ok=True)
    cells = config.cells(cache_dir=cache_dir, tensorboard_dir=os.path.join(out_dir, "tensorboard"))
    write_grid(out_dir, {cell.run_id: cell.cell_hash for cell in cells})
    if not check_workload:
        return cells, None
    workload = load_workload(cells[0])
    for workers in config.workers:
        if workload.batch_size * workers > size(workload.train):
            raise GraceConfigError(
                f"batch_size {workload.batch_size} × {workers} workers exceeds the "
                f"{size(workload.train)} training samples of {workload.name!r}"
            )
    return cells, workload


class SurveyInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`run_grid`, after its ranks were stopped and its files written:
    ``kept`` of the grid's ``total`` runs have their results in the folder."""

    def __init__(self, kept: int, total: int) -> None:
        super().__init__(f"interrupted: {kept} of {total} runs kept")
        self.kept, self.total = kept, total


def run_grid(
    config: "SurveyConfig",
    out_dir: str,
    progress: bool = True,
    network_tag: str | None = None,
    log: Callable[[str], object] = print,
    fresh_ranks: bool = False,
) -> tuple[list[Record], list[tuple[str, str]]]:
    """Run every unfinished cell of ``config`` (only those of ``network_tag`` if given),
    skipping runs whose summary is already in ``out_dir`` (and saying which it reuses, which it
    runs again and why). Cells of a shaped network are run in a shaped namespace (see
    :mod:`grace_survey.running.netem`) unless this process is already inside one with that
    shaping. The cells of one world size run one after another in one
    :class:`~grace_dgc.launch.RankPool` (its ranks started once); ``fresh_ranks`` starts ranks
    for each run instead. Progress bars only where stderr is a terminal (a line per run
    otherwise). Returns (summaries, failures); Ctrl-C raises :class:`SurveyInterrupted` once
    the ranks are stopped. A run recorded removes the projection's files made before it."""
    tqdm = require("tqdm.auto", "the survey's progress bars").tqdm
    progress = progress and _terminal(tqdm)

    earlier = earlier_cells(out_dir) if network_tag is None else {}
    # a shaped-network child runs a share of a grid its parent has already checked
    cells, _ = prepare(config, out_dir, check_workload=network_tag is None and config.script is None)
    if network_tag is not None:
        cells = [c for c in cells if c.network["tag"] == network_tag]
    done = finished_runs(out_dir)
    if network_tag is None:
        for line in plan_lines(cells, done, earlier, read_records(out_dir), out_dir):
            log(line)
    inside = netem.current_shaping()
    by_network: dict[str, list[Cell]] = {}
    for cell in cells:
        by_network.setdefault(cell.network["tag"], []).append(cell)
    _probe_shaped_networks(by_network, done, inside)
    bar = tqdm(
        total=len(cells), desc=f"survey {config.name}", position=0, unit="run", dynamic_ncols=True, disable=not progress
    )
    grid = _GridRun(config, out_dir, progress, fresh_ranks, log, bar, total=len(cells))
    interrupted = False
    with _one_interrupt():
        try:
            grid.run_networks(by_network, done, inside)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            grid.finish(stale_outputs=network_tag is None)  # a shaped network's child: its parent's
    if interrupted:
        finished = finished_runs(out_dir)
        raise SurveyInterrupted(sum(finished.get(c.run_id) == c.cell_hash for c in cells), len(cells))
    return grid.summaries, grid.failures


def _terminal(tqdm: Any) -> bool:
    """Whether progress bars have somewhere to go: stderr is a terminal, or tqdm draws in a
    notebook. A log file gets a line per run instead of the bars' escape codes."""
    return sys.stderr.isatty() or "notebook" in getattr(tqdm, "__module__", "")


@contextlib.contextmanager
def _one_interrupt() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt once; a second one, while the ranks are stopped and the
    files written, is ignored (it would cut that short). As it was after. Python sets handlers
    on the main thread only: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return

    def once(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, once)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _is_shaped(net: Mapping[str, Any]) -> bool:
    return bool(net["bandwidth_bps"]) or net["latency_ms"] > 0


def _probe_shaped_networks(
    by_network: Mapping[str, list[Cell]], done: Mapping[str, str | None], inside: Mapping[str, Any] | None
) -> None:
    """Fail fast: a shaped network this machine cannot make is named before any run, not after hours."""
    for group in by_network.values():
        net = group[0].network
        if _is_shaped(net) and inside is None and any(done.get(c.run_id) != c.cell_hash for c in group):
            netem.probe(net["bandwidth_bps"], net["latency_ms"])


@dataclasses.dataclass
class _GridRun:
    """What the cells of one :func:`run_grid` share: where and how they run, the progress bar,
    the rank pools kept up across runs, and the summaries and failures so far."""

    config: "SurveyConfig"
    out_dir: str
    progress: bool
    fresh_ranks: bool
    log: Callable[[str], object]
    bar: Any
    total: int = 0  # the grid's runs, reused ones included
    done: int = 0  # of them, reused or tried so far
    summaries: list[Record] = dataclasses.field(default_factory=list)
    failures: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    pools: dict[tuple[int, str], RankPool] = dataclasses.field(default_factory=dict)  # (workers, backend) -> ranks

    def run_networks(
        self, by_network: Mapping[str, list[Cell]], done: Mapping[str, str | None], inside: Mapping[str, Any] | None
    ) -> None:
        """The unfinished cells of each network: here, or in a shaped namespace's child survey."""
        for tag, group in by_network.items():
            net = group[0].network
            todo = [c for c in group if done.get(c.run_id) != c.cell_hash]
            self.advance(len(group) - len(todo))
            if not todo:
                continue
            shaped = _is_shaped(net)
            if shaped and (inside is None or inside.get("tag") != tag):
                self.run_shaped_child(tag, net, todo, inside)
                continue
            for cell in todo:
                self.run_cell(cell, shaped)

    def finish(self, stale_outputs: bool) -> None:
        """The ranks stopped, the bar closed, summary.csv written; where a run was recorded and
        ``stale_outputs``, the projection's files made from the results before it removed."""
        for pool in self.pools.values():
            pool.close()  # an interrupted job's ranks are stopped already
        self.bar.close()
        write_summary_csv(self.out_dir)
        removed = remove_stale_outputs(self.out_dir) if self.summaries and stale_outputs else []
        if removed:
            self.log(
                f"[survey] removed {', '.join(removed)}: made from the results before these runs "
                f"(grace-dgc project {self.out_dir} makes them again)"
            )

    def advance(self, runs: int) -> None:
        """``runs`` more of the grid reused or tried."""
        self.done += runs
        self.bar.update(runs)

    def run_shaped_child(
        self, tag: str, net: Mapping[str, Any], todo: list[Cell], inside: Mapping[str, Any] | None
    ) -> None:
        """Run ``todo``, the unfinished cells of shaped network ``tag``, in a child survey in a
        shaped network namespace; its summaries are read back from results.jsonl."""
        if inside is not None:
            raise GraceConfigError(
                f"already inside a shaped network ({inside.get('tag')}); cannot run cells of network {tag!r} here"
            )
        self.log(f"[survey] network {tag}: running {len(todo)} run(s) in a shaped network namespace")
        self.bar.clear()
        command = [sys.executable, "-m", "grace_survey.cli", "survey", "--config"]
        command += [os.path.join(self.out_dir, CONFIG_JSON), "--out", self.out_dir, "--network-tag", tag]
        command += ([] if self.progress else ["--no-progress"]) + (["--fresh-ranks"] if self.fresh_ranks else [])
        code = netem.run_shaped(
            command, bandwidth_bps=net["bandwidth_bps"], latency_ms=net["latency_ms"], check_first=False
        )
        finished = {r["run_id"]: r for r in latest_summaries(read_records(self.out_dir))}
        for cell in todo:
            if finished.get(cell.run_id, {}).get("cell_hash") == cell.cell_hash:
                self.summaries.append(finished[cell.run_id])
            else:
                self.failures.append((cell.run_id, f"shaped-network child exited with {code}"))
        self.advance(len(todo))

    def run_cell(self, cell: Cell, shaped: bool) -> None:
        """Run one cell here (one broken run does not stop the survey: its error is recorded)."""
        backend, device = resolve_runtime(self.config, cell.workers, shaped)
        self.bar.set_postfix_str(cell.run_id)
        try:
            summary = self._train(cell, backend, device)
            assert summary is not None, "rank 0 returns the cell's summary"
            self.summaries.append(summary)
            self.bar.write(
                f"[survey] {self.done + 1}/{self.total} {cell.run_id}: "
                f"test acc {_shown(summary['final_test_accuracy'])}, "
                f"{summary['bytes_per_step']:.0f} B/step, ratio {summary['compression_ratio']:.4g}, "
                f"{summary['train_time_s']:.1f} s"
            )
        except Exception as err:  # one broken run does not stop the survey
            message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
            self.failures.append((cell.run_id, str(err)))
            error = {"type": "error", "run_id": cell.run_id, "cell_hash": cell.cell_hash, "message": str(err)[-4000:]}
            append_record(self.out_dir, error)
            self.bar.write(f"[survey] {self.done + 1}/{self.total} {cell.run_id} FAILED: {message}")
        self.advance(1)

    def _train(self, cell: Cell, backend: str, device: str) -> Record | None:
        """The cell's summary: its script's ranks (script mode), ranks started for it, or the pool's."""
        if cell.script is not None:  # script mode: the user's script is the training
            return run_script_cell(cell, self.out_dir, self.config.timeout, backend, device)
        if cell.fault is not None:  # replica groups under torchft, one process each (see faults)
            from grace_survey.running.faults import run_fault_cell

            return run_fault_cell(cell, self.out_dir, self.config.timeout, device)
        if self.fresh_ranks:
            args = (cell, self.out_dir, self.progress, device, "survey")
            return run_local(run_cell, cell.workers, args, backend=backend, timeout=self.config.timeout)[0]
        pool = self.pools.setdefault((cell.workers, backend), RankPool(cell.workers, backend))
        args = (cell, self.out_dir, self.progress, device, "survey-pool")
        return pool.run(run_cell, args, timeout=self.config.timeout)[0]


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
