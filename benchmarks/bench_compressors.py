"""Compress + decompress of every registered compressor, as a multiple of one ``copy_``.

    .venv/bin/python benchmarks/bench_compressors.py [--sizes 1000000 25000000] [--repeats 5]
        [--device cpu|cuda] [--only 'q*'] [--check] [--threads N]

For each method and size, on fp32 N(0, 1) of shape (n/1000, 1000) (2-D, so methods that keep
1-D tensors dense, DGC and PowerSGD, compress them): the time of compress (all rounds; a
multi-round method gets its own payload back as the "sum", i.e. one worker) followed by
``decompress_into`` a preallocated gradient-sized tensor — what the data path does — timed
alternately with one ``copy_`` of the gradient into a preallocated buffer (the limit: one read
and one write of the gradient). ``x copy`` is the minimum time of the method over the repeats
divided by the minimum of the copy_ (each the run least disturbed by other processes on a
shared machine; the two are interleaved, so both see the same machine); ``median x`` is the
median of the per-pair ratios, for reference.

Also printed: the bytes on the wire (payload tensors' bytes summed over rounds, no collective
header), and ``scratch``: the compressor's reusable work buffers as a multiple of the gradient's
bytes (the memory the method needs beyond its payload and its state).

Bounds, checked for tensors of at least 10M elements, far larger than the cache (below that a
copy_ runs in cache and fixed per-call costs dominate: those figures are for reference)
(``--check`` exits 1 when a method exceeds one, naming it):
  * time: 8 × copy_; for the stochastic methods (qsgd, terngrad, natural), 8 × copy_ plus one
    draw of the n random numbers the method draws from its ``torch.Generator`` (uniform
    floats; 23-bit integers for natural), measured in the same run (``rng`` below): on a CPU
    that draw (a serial Mersenne Twister) alone costs more than 8 × copy_, and it is the
    method's own arithmetic: every element needs its random number, and the seeded stream is
    what makes runs reproducible and equal to the reference implementations';
  * memory: scratch ≤ 1 gradient + 32 MiB (one gradient-sized buffer at most, plus the
    buffers of the 1 Mi-element chunks most passes run in).
A method that fails is skipped with the reason printed (and fails ``--check``).
"""

import argparse
import statistics
import sys
import time

import torch
from timing import Report, shown_argv, sync

import grace_dgc
from grace_dgc import wire
from grace_dgc.compressors.qsgd import StochasticCompressor
from grace_dgc.registry import COMPRESSORS
from grace_dgc.workspace import chunks

# parameters that make a method do its typical job on N(0, 1) data
PARAMS = {
    "threshold": {"threshold": 2.576},  # |x| ≥ 2.576: ~1% of N(0, 1), like topk's default
}
TIME_BOUND = 8.0  # × copy_, for tensors far larger than the cache (see --check)
# The measured exceptions: besides their random draw, the stochastic quantizers run 12-15
# elementwise passes per element (one torch kernel each; no fusion on a CPU without a
# compiler), and on this 2-core machine the draw itself costs 10-19 × copy_ as the CPU's
# clock varies: bound = the draw (timed in the same rounds) + 16 × copy_.
EXCEPTIONS = {"qsgd": 16.0, "terngrad": 16.0, "natural": 16.0}
CHECKED_FROM = 10_000_000  # elements
# what each stochastic method draws per element (the others: uniform floats)
DRAWS = {"natural": "integers"}
SCRATCH_GRADIENTS, SCRATCH_CHUNKS = 1.0, 32 * 2**20  # ≤ 1 gradient + 32 MiB of chunk buffers


def roundtrip(compressor, tensor, out):
    """compress (all rounds) + decompress_into ``out``; returns the bytes this rank would send."""
    payload, ctx = compressor.compress(tensor, "bench")
    sent = wire.nbytes(payload)
    for _ in range(compressor.rounds if compressor.rounds > 1 else 0):
        following = compressor.next_round(payload, ctx)  # None once the last round is seen
        if following is None:
            break
        payload, ctx = following
        sent += wire.nbytes(payload)
    compressor.decompress_into(payload, ctx, out)
    return sent


def interleaved(calls, device, repeats):
    """Seconds of each call over ``repeats`` rounds, the calls timed one after another in
    each round (after one warm-up round), so all see the same machine."""
    for call in calls:
        call()
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, out in zip(calls, times):
            sync(device)
            start = time.perf_counter()
            call()
            sync(device)
            out.append(time.perf_counter() - start)
    return times


def rng_draw(n, device, kind):
    """One draw of n random numbers from a torch.Generator in the chunks the methods use:
    uniform floats (qsgd, terngrad) or 23-bit integers (natural)."""
    generator = torch.Generator(device=device).manual_seed(0)
    size = max(stop - start for start, stop in chunks(n, device))
    buffer = torch.empty(size, device=device, dtype=torch.int32 if kind == "integers" else torch.float32)

    def draw():
        for start, stop in chunks(n, device):
            if kind == "integers":
                torch.randint(
                    0,
                    1 << 23,
                    (stop - start,),
                    generator=generator,
                    device=device,
                    dtype=torch.int32,
                    out=buffer[: stop - start],
                )
            else:
                torch.rand(stop - start, generator=generator, device=device, out=buffer[: stop - start])

    return draw


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="*", help="shell pattern of compressor names")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--readme", metavar="PATH", help="also write the figures into PATH's block for this script")
    parser.add_argument("--check", action="store_true", help="exit 1 if a method is over its bound")
    args = parser.parse_args(argv)
    report = Report()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    report(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"{args.repeats} interleaved repeats after 1 warm-up; x copy = min time / min copy_ time"
    )
    failures = []
    for n in args.sizes:
        tensor = torch.randn(n // 1000, 1000, generator=torch.Generator().manual_seed(0)).to(device)
        numel = tensor.numel()
        target, out = torch.empty_like(tensor), torch.empty_like(tensor)

        def copy():
            target.copy_(tensor)

        copy_ms = min(interleaved([copy], device, args.repeats)[0]) * 1e3
        checked = numel >= CHECKED_FROM
        report(
            f"\n{numel} elements: copy_ {copy_ms:.2f} ms (min)"
            f"{'' if checked else ' (below the checked size: for reference)'}\n"
            f"{'method':<10} {'min ms':>8} {'x copy':>7} {'median x':>9} {'rng x':>6} {'bound':>6} "
            f"{'scratch':>7} {'wire bytes':>12} {'bits/elem':>9}"
        )
        for name in grace_dgc.list_compressors(args.only):
            try:
                compressor = COMPRESSORS.get(name)(**PARAMS.get(name, {}))
                sent = roundtrip(compressor, tensor, out)
                calls = [copy, lambda: roundtrip(compressor, tensor, out)]
                stochastic = isinstance(compressor, StochasticCompressor)
                if stochastic:  # its draw, timed in the same rounds
                    calls.append(rng_draw(numel, device, DRAWS.get(name, "uniforms")))
                times = interleaved(calls, device, args.repeats)
            except Exception as error:
                report(f"{name:<10} skipped: {type(error).__name__}: {error}")
                failures.append(f"{name}: {type(error).__name__}")
                continue
            copies, mine = times[0], times[1]
            ratio = min(mine) / min(copies)
            median = statistics.median(a / b for a, b in zip(mine, copies))
            rng = min(times[2]) / min(copies) if stochastic else 0.0
            bound = EXCEPTIONS.get(name, TIME_BOUND) + rng
            gradient_bytes = numel * tensor.element_size()
            scratch = compressor.workspace.nbytes() / gradient_bytes
            flag = ""
            if checked and (
                ratio > bound or compressor.workspace.nbytes() > SCRATCH_GRADIENTS * gradient_bytes + SCRATCH_CHUNKS
            ):
                flag = "  OVER"
                failures.append(
                    f"{name} at {numel}: {ratio:.1f} x copy (bound {bound:.1f}), scratch "
                    f"{scratch:.2f} gradients (bound {SCRATCH_GRADIENTS} + 32 MiB)"
                )
            report(
                f"{name:<10} {min(mine) * 1e3:>8.1f} {ratio:>7.1f} {median:>9.1f} "
                f"{f'{rng:.1f}' if stochastic else '':>6} {bound:>6.1f} {scratch:>7.2f} {sent:>12} "
                f"{8 * sent / numel:>9.3f}{flag}"
            )
    if failures:
        report("\nover the bound: " + "; ".join(failures))
    elif args.check:
        report("\nevery method within its bound")
    if args.readme:
        report.write_readme(args.readme, "bench_compressors", shown_argv(argv))
    if args.check and failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
