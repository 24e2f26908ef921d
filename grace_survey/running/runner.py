"""The survey under torchrun / horovodrun (``python -m grace_survey.running.runner``), and
where the survey's pieces are, one job per module:

    context   the rank's runtime (engine: rank, size, backend; device)
    cell      one run of the grid (a dataclass) and its fingerprints
    train     the measured training loop        metrics   what a rank measures per epoch
    tuning    per-method lr tuning              execute   one cell: lr, training, summary line
    results   results.jsonl / summary.csv       grid      every cell, shaped networks
    summary   the summary line, metric names    script    script mode: its API, its supervisor
    config    the TOML schema and grid          presets   the built-in grids


One *cell* (method × workers × seed × network) is trained by :func:`run_cell`, called
once per rank. The same code runs under

* :func:`grace_dgc.launch.run_local` (what ``grace-dgc survey`` does: one gloo/NCCL
  process group on localhost per cell),
* ``torchrun --nproc-per-node N -m grace_survey.running.runner --config C --out D``, and
* ``horovodrun -np N python -m grace_survey.running.runner --config C --out D``
  (detected from Horovod's environment; ``--launcher horovod`` forces it),

where :func:`main` initialises the runtime from the environment and trains every cell
of the grid whose worker count equals the world size.

Fairness: ``torch.manual_seed(seed)`` right before ``make_model()`` (the same initial
weights for every method), a ``torch.Generator`` seeded from (seed, epoch) draws the
epoch's permutation (the same data order for every method); global batch = per-worker
batch × workers, rank r takes rows [r·b, (r+1)·b) of each global batch.

Measurements (all per optimizer step unless stated; every figure is measured):
  compute_s      forward + backward wall time on the training thread (CUDA-synchronised);
                 gradient exchanges start during backward on grace's communication
                 thread, so on CPU they compete with it for cores
  compress_s, communicate_s, decompress_s
                 grace.stats() timers on the communication thread (may overlap compute)
  wait_s         optimizer.step() wall time: waiting for the exchanges still in flight
                 after backward, plus the parameter update
  step_s         compute_s + wait_s (forward start → update done; no data loading)
  bytes_per_step bytes this worker handed to collectives (grace.stats(), padding and
                 size headers included), mean over workers
  compression_ratio  Σ bytes_sent / Σ dense fp32 bytes of the same gradients
  samples_per_s  global samples per second of training wall time (data loading included,
                 evaluation excluded)
The first ``timing_skip_steps`` steps of a run (thread start-up, allocator warm-up) are
left out of the per-step time means, not out of bytes or samples/s.
"""

import argparse
import os
import sys
from collections.abc import Sequence

import torch

# the survey's API, re-exported where it was before the split
from grace_dgc import environment
from grace_dgc.errors import GraceConfigError
from grace_survey.config.cell import Cell  # noqa: F401
from grace_survey.running.context import Context
from grace_survey.running.execute import execute_cell, run_cell  # noqa: F401
from grace_survey.running.grid import prepare, resolve_runtime, run_grid  # noqa: F401
from grace_survey.running.metrics import RankTotals  # noqa: F401
from grace_survey.running.results import (  # noqa: F401
    CONFIG_JSON,
    RESULTS,
    SUMMARY_COLUMNS,
    SUMMARY_CSV,
    append_record,
    finished_runs,
    latest_summaries,
    read_records,
    write_summary_csv,
)
from grace_survey.running.summary import netem_shaping  # noqa: F401
from grace_survey.running.train import evaluate, load_workload, train  # noqa: F401
from grace_survey.running.tuning import holdout_split, tune_lr  # noqa: F401


# ----------------------------------------------------------------------------- torchrun / horovodrun
def _init_runtime(launcher: str, backend: str) -> str:
    """Initialise Horovod or torch.distributed from the launcher's environment."""
    if launcher == "auto":
        if "HOROVOD_RANK" in os.environ or "HOROVOD_HOSTNAME" in os.environ:
            launcher = "horovod"
        elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            launcher = "torchrun"
        else:
            launcher = "local"
    if launcher == "horovod":
        import horovod.torch as hvd

        hvd.init()
    elif launcher == "torchrun":
        import torch.distributed as dist

        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device((environment.read_int("LOCAL_RANK", 0) or 0) % torch.cuda.device_count())
        dist.init_process_group(backend)
    return launcher


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m grace_survey.running.runner`` under torchrun / horovodrun (or alone, 1 rank)."""
    from grace_survey.config.settings import load_config, load_preset

    parser = argparse.ArgumentParser(prog="python -m grace_survey.running.runner", description=main.__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="TOML config (or a survey_config.json)")
    source.add_argument("--preset", help="a preset name")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir")
    parser.add_argument("--launcher", choices=("auto", "torchrun", "horovod", "local"), default="auto")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    config = load_config(args.config) if args.config else load_preset(args.preset, args.data_dir)
    if config.script is not None:
        raise GraceConfigError(
            "script mode runs from `grace-dgc survey --script ...` (its --launcher starts torchrun or horovodrun per "
            "cell); the runner module trains built-in and plugin workloads"
        )
    _init_runtime(args.launcher, config.backend)
    ctx = Context.detect(config.device)
    cells = prepare(config, args.out)[0] if ctx.rank == 0 else None
    cells = ctx.broadcast_object(cells)
    mine = [c for c in cells if c.workers == ctx.size and not (c.network["bandwidth_bps"] or c.network["latency_ms"])]
    if ctx.rank == 0 and len(mine) < len(cells):
        print(
            f"[survey] world size {ctx.size}: running {len(mine)} of {len(cells)} runs "
            f"(the others need another worker count or a shaped network)",
            file=sys.stderr,
        )
    for cell in mine:
        done = finished_runs(args.out) if ctx.rank == 0 else None
        if ctx.broadcast_object(done).get(cell.run_id) == cell.cell_hash:
            continue
        execute_cell(ctx, cell, args.out, progress=not args.no_progress)
    if ctx.rank == 0:
        write_summary_csv(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
