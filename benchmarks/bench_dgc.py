"""DGC's sampled selection against exact ``torch.topk`` on large tensors.

    .venv/bin/python benchmarks/bench_dgc.py [--sizes 1000000 25000000] [--ratio 0.001]
        [--repeats 5] [--device cpu|cuda] [--threads N]

For each size, on fp32 N(0, 1) data of shape (n/1000, 1000), the best wall time over the
repeats (robust to other load on a shared machine) of:
  select  — DGCCompressor.select(|g|, k): strided sample → top-k of the sample → threshold
            → candidates (→ top-k of the candidates when > 1.3k)  vs  torch.topk(|g|, k);
  compress — the whole compress call (|g|, selection, gather, int32 indices) of ``dgc``
            vs ``topk``;
and the ratio exact/DGC (> 1: DGC is faster), plus the mean sent count / k over the runs
(each run draws a new random sample start).
"""

import argparse
import statistics

import torch
from timing import timed

import grace_dgc


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dgc = grace_dgc.build("dgc", compress_ratio=args.ratio, communicator="allgather", engine="local").compressor
    topk = grace_dgc.build("topk", compress_ratio=args.ratio, communicator="allgather", engine="local").compressor
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} ratio={args.ratio}")
    print(
        f"{'elements':>10} {'k':>7} | {'topk sel ms':>11} {'dgc sel ms':>10} {'speed-up':>8} | "
        f"{'topk cmp ms':>11} {'dgc cmp ms':>10} {'speed-up':>8} | sent/k"
    )
    for n in args.sizes:
        gen = torch.Generator().manual_seed(n)
        grad = torch.randn(n // 1000, 1000, generator=gen).to(device)
        importance = grad.reshape(-1).abs()
        k = max(1, int(n * args.ratio))
        sent = []
        _, exact_sel = timed(lambda: torch.topk(importance, k, sorted=False), device, args.repeats)
        _, dgc_sel = timed(lambda: sent.append(dgc.select(importance, k).numel()), device, args.repeats)
        _, exact_cmp = timed(lambda: topk.compress(grad, "g"), device, args.repeats)
        _, dgc_cmp = timed(lambda: dgc.compress(grad, "g"), device, args.repeats)
        print(
            f"{n:>10} {k:>7} | {exact_sel * 1e3:>11.2f} {dgc_sel * 1e3:>10.2f} {exact_sel / dgc_sel:>7.1f}x | "
            f"{exact_cmp * 1e3:>11.2f} {dgc_cmp * 1e3:>10.2f} {exact_cmp / dgc_cmp:>7.1f}x | "
            f"{statistics.mean(sent) / k:.3f}"
        )


if __name__ == "__main__":
    main()
