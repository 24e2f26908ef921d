"""Compress + decompress time of every registered compressor, against one clone().

    .venv/bin/python benchmarks/bench_compressors.py [--sizes 1000000 25000000] [--repeats 3]
        [--device cpu|cuda] [--only 'q*']

For each method and size: the wall time of compress (all rounds; a multi-round method
gets its own payload back as the "sum", i.e. one worker) + decompress, median and minimum
of the repeats (the minimum is the least disturbed by other processes on a shared
machine), the ratio of the minimum to the minimum of one ``tensor.clone()`` timed in the
same run, and the bytes on the wire (the
payload tensors' bytes, summed over rounds; no collective header). Inputs are fp32 N(0, 1)
of shape (n/1000, 1000): 2-D, so methods that keep 1-D tensors dense (DGC, PowerSGD)
compress them. A method that fails is skipped with the reason printed, so methods added
later are picked up (or reported) without editing this script.
"""
import argparse

import torch

import grace_dgc
from timing import timed
from grace_dgc import wire
from grace_dgc.registry import COMPRESSORS

# parameters that make a method do its typical job on N(0, 1) data
PARAMS = {
    "threshold": {"threshold": 2.576},      # |x| ≥ 2.576: ~1% of N(0, 1), like topk's default
}


def roundtrip(compressor, tensor):
    """compress (all rounds) + decompress; returns the bytes this rank would send."""
    payload, ctx = compressor.compress(tensor, "bench")
    sent = wire.nbytes(payload)
    for _ in range(compressor.rounds if compressor.rounds > 1 else 0):
        following = compressor.next_round(payload, ctx)     # None once the last round is seen
        if following is None:
            break
        payload, ctx = following
        sent += wire.nbytes(payload)
    compressor.decompress(payload, ctx)
    return sent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="*", help="shell pattern of compressor names")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"{args.repeats} repeats after 1 warm-up")
    header = (f"{'method':<10} {'elements':>10} {'median ms':>10} {'min ms':>9} {'x clone':>8} "
              f"{'wire bytes':>12} {'bits/elem':>9}")
    for n in args.sizes:
        tensor = torch.randn(n // 1000, 1000, generator=torch.Generator().manual_seed(0)).to(device)
        numel = tensor.numel()
        clone_median, clone_min = timed(tensor.clone, device, max(args.repeats, 10))
        print(f"\n{numel} elements; clone(): median {clone_median * 1e3:.2f} ms, "
              f"min {clone_min * 1e3:.2f} ms\n{header}")
        for name in grace_dgc.list_compressors(args.only):
            try:
                compressor = COMPRESSORS.get(name)(**PARAMS.get(name, {}))
                sent = roundtrip(compressor, tensor)
                median, fastest = timed(lambda: roundtrip(compressor, tensor), device, args.repeats)
            except Exception as error:      # noqa: BLE001  report and go on with the others
                print(f"{name:<10} skipped: {type(error).__name__}: {error}")
                continue
            print(f"{name:<10} {numel:>10} {median * 1e3:>10.1f} {fastest * 1e3:>9.1f} "
                  f"{fastest / clone_min:>8.1f} {sent:>12} {8 * sent / numel:>9.3f}")


if __name__ == "__main__":
    main()
