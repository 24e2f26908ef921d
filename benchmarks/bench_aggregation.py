"""Bytes per rank per step of each communicator as the number of ranks grows.

    .venv/bin/python benchmarks/bench_aggregation.py [--worlds 2 3 4] [--steps 3]

On a 1000×1000 fp32 gradient (N(0, 1), a different seed per rank), gloo ranks on
localhost, for topk 1 % (allgather, sparse_allreduce, sparse_allreduce with gTop-k), qsgd
(allgather, reduce_scatter) and thc (4 bits: allreduce, allgather; 7 bits: allreduce, whose
int8 codes widen to int32 once N·63 > 127): per rank and step, ``bytes_sent`` and
``bytes_received`` from ``grace.stats()`` (docs/how-it-works.md says what each counts), and the
bytes the loopback interface carried (/proc/net/dev, lo transmit counter, all ranks
together, divided by the ranks; includes TCP/IP headers), the mean over ``--steps`` steps
after one warm-up step; and the error of the last step's output against the exact average
of the ranks' gradients, ‖out − mean‖₂ / ‖mean‖₂ (rank 0; no memory). Also the wall time
per step (median of the steps, rank 0), for orientation only.
"""

import argparse
import statistics
import time

import torch

import grace_dgc
from grace_dgc.launch import run_local

CASES = [
    ("topk 1%", "topk", "allgather", {"compress_ratio": 0.01}),
    ("topk 1%", "topk", "sparse_allreduce", {"compress_ratio": 0.01}),
    ("topk 1% gTop-k", "topk", "sparse_allreduce", {"compress_ratio": 0.01, "global_topk": True}),
    ("qsgd", "qsgd", "allgather", {}),
    ("qsgd", "qsgd", "reduce_scatter", {}),
    ("thc", "thc", "allreduce", {}),
    ("thc", "thc", "allgather", {}),
    ("thc 7-bit", "thc", "allreduce", {"bits": 7}),
]


def loopback_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])  # transmit bytes
    return 0


def job(rank, world, steps):
    def gradient(r):
        return torch.randn(1000, 1000, generator=torch.Generator().manual_seed(r))

    g = gradient(rank)
    mean = sum(gradient(r) for r in range(world)) / world
    out = {}
    for label, comp, comm, params in CASES:
        grace = grace_dgc.build(comp, "none", comm, **params)
        grace.step(g, "g")  # warm-up
        grace.engine.barrier()
        grace.reset_stats()
        wire, times = loopback_bytes(), []
        for _ in range(steps):
            start = time.perf_counter()
            result = grace.step(g, "g")
            times.append(time.perf_counter() - start)
        grace.engine.barrier()
        stats = grace.stats()
        out[(label, comm)] = {
            "sent": stats["bytes_sent"] / steps,
            "received": stats["bytes_received"] / steps,
            "loopback": (loopback_bytes() - wire) / steps / world,
            "ms": statistics.median(times) * 1000,
            "error": float((result - mean).norm() / mean.norm()),
        }
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    results = {world: run_local(job, world, args=(args.steps,))[0] for world in args.worlds}
    print(
        f"torch={torch.__version__}; bytes per rank per step (KB = 1000 B); loopback: all ranks' lo tx / N; "
        "rel.err: ‖out − exact mean‖ / ‖exact mean‖"
    )
    header = f"{'method':<16} {'communicator':<17}" + "".join(
        f" | N={w}: sent  received  loopback  rel.err" for w in args.worlds
    )
    print(header + " | N=max/N=min (loopback)")
    for label, _, comm, _ in CASES:
        row = f"{label:<16} {comm:<17}"
        for world in args.worlds:
            r = results[world][(label, comm)]
            row += f" | {r['sent'] / 1e3:9.1f} {r['received'] / 1e3:9.1f} {r['loopback'] / 1e3:9.1f} {r['error']:8.4f}"
        first, last = results[args.worlds[0]][(label, comm)], results[args.worlds[-1]][(label, comm)]
        print(row + f" | {last['loopback'] / first['loopback']:.2f}×")
    print("\nwall ms per step (rank 0, median):")
    for label, _, comm, _ in CASES:
        print(
            f"{label:<16} {comm:<17}" + "".join(f" N={w}: {results[w][(label, comm)]['ms']:7.1f}" for w in args.worlds)
        )


if __name__ == "__main__":
    main()
