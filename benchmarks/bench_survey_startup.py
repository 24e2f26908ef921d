"""What a survey run costs besides its training: ranks started for every run (``run_local``,
``grace-dgc survey --fresh-ranks``) against one pool of ranks kept up across runs
(:class:`grace_dgc.launch.RankPool`, the survey's default). Issue 41's goal: under 1 s per run
after the first.

    python benchmarks/bench_survey_startup.py [--runs 6] [--workers 2] [--repeats 2] [--load 0]

Each run is one cell of a tiny survey (digits-mlp, a few steps), launched as ``run_grid``
launches it. Its overhead is the wall time of the launch less the run's own ``train_time_s``
(so data loading, the model, evaluation and the process start are in it, alike for both ways).
Fresh and pooled alternate (A B A B), each ``--repeats`` times; the figures are medians over
the runs after the first of each pass (the first pooled run starts the pool), with the first
runs shown apart. ``--load N`` runs N busy processes beside it (a machine with company).
"""

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grace_dgc, uninstalled


def busy() -> None:
    while True:
        sum(i * i for i in range(10_000))


def one_pass(pooled: bool, runs: int, workers: int) -> list[float]:
    from grace_dgc.launch import RankPool, run_local
    from grace_survey.config.settings import SurveyConfig
    from grace_survey.running.execute import run_cell
    from grace_survey.running.grid import prepare

    config = SurveyConfig(
        {
            "name": "startup",
            "workload": "digits-mlp",
            "workers": workers,
            "epochs": 1,
            "max_steps": 3,
            "workload_options": {"train_samples": 512, "test_samples": 100},
            "methods": [{"label": f"dense {i}", "compressor": "none", "lr": 0.05 + 0.01 * i} for i in range(runs)],
        }
    )
    overheads = []
    with tempfile.TemporaryDirectory() as out:
        cells, _ = prepare(config, out)
        pool = RankPool(workers) if pooled else None
        try:
            for cell in cells:
                started = time.perf_counter()
                if pool is not None:
                    summary = pool.run(run_cell, (cell, out, False, "cpu", "survey-pool"))[0]
                else:
                    summary = run_local(run_cell, workers, (cell, out, False, "cpu", "survey"))[0]
                overheads.append(time.perf_counter() - started - summary["train_time_s"])
        finally:
            if pool is not None:
                pool.close()
    return overheads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the benchmark")
    args = parser.parse_args()
    neighbours = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for proc in neighbours:
        proc.start()
    import torch

    firsts: dict[str, list[float]] = {"fresh": [], "pooled": []}
    laters: dict[str, list[float]] = {"fresh": [], "pooled": []}
    try:
        for _ in range(args.repeats):
            for name in ("fresh", "pooled"):
                got = one_pass(name == "pooled", args.runs, args.workers)
                firsts[name].append(got[0])
                laters[name].extend(got[1:])
    finally:
        for proc in neighbours:
            proc.kill()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, {args.workers} gloo ranks, {args.runs} runs per pass, "
        f"{args.repeats} passes each way (A B A B), {args.load} busy neighbour process(es)"
    )
    print("overhead per run = launch wall time − the run's train_time_s (data, model, evaluation, start-up)")
    print(f"{'ranks':8} {'first run s':>12} {'later runs s (median)':>22} {'min':>6} {'max':>6}")
    for name in ("fresh", "pooled"):
        later = laters[name]
        print(
            f"{name:8} {statistics.median(firsts[name]):12.2f} {statistics.median(later):22.2f} "
            f"{min(later):6.2f} {max(later):6.2f}"
        )
    saved = statistics.median(laters["fresh"]) - statistics.median(laters["pooled"])
    print(f"saved per run after the first: {saved:.2f} s (median fresh − median pooled)")
    print(f"command: python benchmarks/bench_survey_startup.py --runs {args.runs} --workers {args.workers} "
          f"--repeats {args.repeats} --load {args.load}")  # fmt: skip


if __name__ == "__main__":
    main()
