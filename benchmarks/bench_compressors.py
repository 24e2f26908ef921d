"""Compress + decompress of every registered compressor, as a multiple of one ``copy_``: on a
quiet machine and beside a competing process, against grace_dgc at an earlier commit and GRACE.

    .venv/bin/python benchmarks/bench_compressors.py [--sizes 1000000 25000000 | --sweep]
        [--repeats 5] [--device cpu|cuda] [--only 'q*'] [--check] [--threads N]
        [--load THREADS] [--baseline REV] [--grace PATH] [--readme PATH [--block NAME]]

For each method and size, on fp32 N(0, 1) of shape (n/1000, 1000) (2-D, so methods that keep
1-D tensors dense, DGC and PowerSGD, compress them): the time of compress (all rounds; a
multi-round method gets its own payload back as the "sum", i.e. one worker) followed by
``decompress_into`` a preallocated gradient-sized tensor — what the data path does — timed
alternately with one ``copy_`` of the gradient into a preallocated buffer (the limit: one read
and one write of the gradient). ``x copy`` is the minimum time of the method over the repeats
divided by the minimum of the copy_ (each the run least disturbed by other processes on a
shared machine; the two are interleaved, so both see the same machine); ``median x`` is the
median of the per-pair ratios, for reference. Below 1M elements a sample is the mean of
several calls (at least ~1M elements in all), so timer resolution does not decide.

Also printed: the bytes on the wire (payload tensors' bytes summed over rounds, no collective
header), and ``scratch``: the compressor's reusable work buffers as a multiple of the gradient's
bytes (the memory the method needs beyond its payload and its state).

Field conditions (issue 18):
  * ``--load THREADS`` starts a competing process (a loop of abs/compare/sum over 25M fp32
    elements on THREADS torch threads: real training always has company) and times every
    round twice, the competitor stopped (SIGSTOP: quiet) and running (loaded); ``loaded ms``
    is the median loaded time, ``max`` the worst, ``slow-down`` median loaded / median quiet.
    The competitor is killed by its own process id at the end, whatever happens.
  * ``--baseline REV`` also times grace_dgc's compressors as of git revision REV (e.g. 0c96840,
    before the chunked rewrite), extracted with ``git archive`` and imported beside today's;
    timed like today's (``decompress_into`` the same tensor) where that revision has it.
  * ``--grace PATH`` also times the GRACE framework's implementations (``grace_dl.dist``; PATH
    is a checkout of https://github.com/sands-lab/grace) with the same parameters; natural
    (CuPy only) and PowerSGD (communicates inside compress) have none there. Those return a
    fresh tensor from ``decompress`` (their data path); ours writes into the gradient.
  * ``vs quiet``/``vs loaded``: the other implementation's time / grace_dgc's (min quiet,
    median loaded); above 1 grace_dgc is faster.
  * ``--sweep``: sizes 1K, 16K, 256K, 1M, 25M.

Bounds, checked for tensors of at least 10M elements, far larger than the cache (below that a
copy_ runs in cache and fixed per-call costs dominate: those figures are for reference)
(``--check`` exits 1 when a method exceeds one, naming it):
  * time: 8 × copy_; for the stochastic methods (qsgd, terngrad, natural), 16 × copy_ plus one
    draw of the n random numbers the method draws from its ``torch.Generator`` (uniform
    floats; 23-bit integers for natural), measured in the same run (``rng`` below): on a CPU
    that draw (a serial Mersenne Twister) alone costs more than 8 × copy_, and it is the
    method's own arithmetic: every element needs its random number, and the seeded stream is
    what makes runs reproducible and equal to the reference implementations';
  * memory: scratch ≤ 1 gradient + 16 MiB per chunk worker (one gradient-sized buffer at
    most — the stochastic methods' pre-drawn random stream — plus each worker's buffers for
    the 512 Ki-element chunks the passes run in).
With ``--load``/``--baseline``/``--grace``, ``--check`` also holds the goals of issue 18: a
slow-down ≤ 4 under load, and grace_dgc no slower than the other implementations (quiet, at
every size; loaded, than GRACE), each with 10 % allowed for noise.
A method that fails is skipped with the reason printed (and fails ``--check``).
"""

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from timing import Competitor, Report, shown_argv, sync

import grace_dgc
from grace_dgc import wire
from grace_dgc.compressors.stochastic import StochasticCompressor
from grace_dgc.registry import COMPRESSORS

# parameters that make a method do its typical job on N(0, 1) data
PARAMS = {
    "threshold": {"threshold": 2.576},  # |x| ≥ 2.576: ~1% of N(0, 1), like topk's default
}
TIME_BOUND = 8.0  # × copy_, for tensors far larger than the cache (see --check)
# The measured exceptions: besides their random draw, the stochastic quantizers run 12-15
# elementwise passes per element (one torch kernel each; no fusion on a CPU without a
# compiler), and on this 2-core machine the draw itself costs 10-19 × copy_ as the CPU's
# clock varies: bound = the draw (timed in the same rounds) + 16 × copy_.
# stochastic rounding (16 + the draw), and transforms the method is made of: demo's blockwise
# DCT (two matrix products per block), thc's Walsh–Hadamard transform (log2 d passes each way on a CPU;
# 1 + ⌈(log2 d − 12)/7⌉ fused passes on a GPU)
EXCEPTIONS = {"qsgd": 16.0, "terngrad": 16.0, "natural": 16.0, "demo": 48.0, "thc": 16.0}
CHECKED_FROM = 10_000_000  # elements
# what each stochastic method draws per element (the others: uniform floats)
DRAWS = {"natural": "integers"}
SCRATCH_GRADIENTS, SCRATCH_PER_WORKER = 1.0, 16 * 2**20  # ≤ 1 gradient + 16 MiB per chunk worker
SWEEP = [1_000, 16_000, 256_000, 1_000_000, 25_000_000]
SAMPLE_ELEMENTS = 1_000_000  # a sample of a small size is the mean of this many elements' calls
LOAD_GOAL, NOISE = 4.0, 1.1  # issue 18: ≤ 4× slower under load; comparisons allow 10 % noise
# GRACE's classes (grace_dl.dist.compressor.<module>) and their arguments from ours
GRACE = {
    "none": ("none", "NoneCompressor", lambda c: {}),
    "fp16": ("fp16", "FP16Compressor", lambda c: {}),
    "topk": ("topk", "TopKCompressor", lambda c: {"compress_ratio": c.compress_ratio}),
    "randomk": ("randomk", "RandomKCompressor", lambda c: {"compress_ratio": c.compress_ratio}),
    "dgc": ("dgc", "DgcCompressor", lambda c: {"compress_ratio": c.compress_ratio}),
    "threshold": ("threshold", "ThresholdCompressor", lambda c: {"threshold": c.threshold}),
    "qsgd": ("qsgd", "QSGDCompressor", lambda c: {"quantum_num": c.quantum_num, "bucket_size": c.bucket_size}),
    "terngrad": ("terngrad", "TernGradCompressor", lambda c: {}),
    "signsgd": ("signsgd", "SignSGDCompressor", lambda c: {}),
    "signum": ("signum", "SignumCompressor", lambda c: {"momentum": c.momentum}),
    "efsignsgd": ("efsignsgd", "EFSignSGDCompressor", lambda c: {"lr": 0.1}),
    "onebit": ("onebit", "OneBitCompressor", lambda c: {}),
}


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


def returning_roundtrip(compressor, tensor):
    """The same for an API whose ``decompress`` returns a new tensor (GRACE, grace_dgc before
    ``decompress_into``)."""
    payload, ctx = compressor.compress(tensor, "bench")
    for _ in range(getattr(compressor, "rounds", 1) - 1):
        following = compressor.next_round(payload, ctx)
        if following is None:
            break
        payload, ctx = following
    return compressor.decompress(payload, ctx)


def sample(call, device, inner):
    """Seconds per call, the mean of ``inner`` calls."""
    sync(device)
    start = time.perf_counter()
    for _ in range(inner):
        call()
    sync(device)
    return (time.perf_counter() - start) / inner


def interleaved(calls, device, repeats, inner=1, competitor=None, loaded=0):
    """Seconds of each call over ``repeats`` rounds, the calls timed one after another in each
    round (after one warm-up round), so all see the same machine: ``(quiet, loaded)`` lists
    per call; with a ``competitor``, each round also times the first ``loaded`` calls while it
    runs (else ``loaded`` lists stay empty)."""
    for call in calls:
        call()
    quiet, busy = [[] for _ in calls], [[] for _ in calls[:loaded]]
    for _ in range(repeats):
        if competitor is not None:
            competitor.pause()
        for call, out in zip(calls, quiet):
            out.append(sample(call, device, inner))
        if competitor is not None and loaded:
            competitor.resume()
            for call, out in zip(calls, busy):
                out.append(sample(call, device, inner))
    return quiet, busy


def rng_draw(n, device, kind):
    """One draw of n random numbers from a torch.Generator into a preallocated buffer, as the
    stochastic methods draw their stream: uniform floats (qsgd, terngrad) or 23-bit integers
    (natural)."""
    generator = torch.Generator(device=device).manual_seed(0)
    buffer = torch.empty(n, device=device, dtype=torch.int32 if kind == "integers" else torch.float32)

    def draw():
        if kind == "integers":
            torch.randint(0, 1 << 23, (n,), generator=generator, device=device, dtype=torch.int32, out=buffer)
        else:
            torch.rand(n, generator=generator, device=device, out=buffer)

    return draw


def import_baseline(rev, into):
    """grace_dgc as of git revision ``rev``, imported as the package ``grace_dgc_<rev>``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "archive", rev, "grace_dgc"], cwd=root, capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"--baseline {rev}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    package = f"grace_dgc_{rev}".replace("-", "_").replace(".", "_")
    os.rename(os.path.join(into, "grace_dgc"), os.path.join(into, package))
    sys.path.insert(0, into)
    return importlib.import_module(f"{package}.registry").COMPRESSORS


def import_grace(path):
    """GRACE's ``grace_dl.dist.compressor`` package from a checkout at ``path``."""
    if not os.path.isfile(os.path.join(path, "grace_dl", "dist", "__init__.py")):
        raise SystemExit(f"--grace {path}: no grace_dl/dist there; give a checkout of github.com/sands-lab/grace")
    sys.path.insert(0, os.path.abspath(path))
    return lambda module: importlib.import_module(f"grace_dl.dist.compressor.{module}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--sweep", action="store_true", help="sizes 1K, 16K, 256K, 1M and 25M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="*", help="shell pattern of compressor names")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--load", type=int, metavar="THREADS", help="time beside a competing THREADS-thread process")
    parser.add_argument("--baseline", metavar="REV", help="also time grace_dgc's compressors at git revision REV")
    parser.add_argument("--grace", metavar="PATH", help="also time GRACE's compressors (a checkout at PATH)")
    parser.add_argument("--readme", metavar="PATH", help="also write the figures into PATH's block for this script")
    parser.add_argument("--block", metavar="NAME", help="the block's name in --readme (default: bench_compressors)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a method is over its bound")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch_dir:
        baseline = import_baseline(args.baseline, scratch_dir) if args.baseline else None
        grace = import_grace(args.grace) if args.grace else None
        competitor = Competitor(args.load) if args.load else None
        try:
            report, failures = run(args, baseline, grace, competitor)
        finally:
            if competitor is not None:
                competitor.stop()
    if args.readme:
        report.write_readme(args.readme, "bench_compressors", shown_argv(argv), args.block)
    if args.check and failures:
        sys.exit(1)


def run(args, baseline, grace, competitor):
    report, failures = Report(), []
    device = torch.device(args.device)
    workers = torch.get_num_threads() if device.type == "cpu" else 1
    others = ([args.baseline] if baseline else []) + (["GRACE"] if grace else [])
    report(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"{args.repeats} interleaved repeats after 1 warm-up; x copy = min time / min copy_ time"
        + (f"; loaded: beside a {args.load}-thread competitor, median of the repeats" if competitor else "")
    )
    header = (
        f"{'method':<10} {'impl':<9} {'min ms':>8} {'x copy':>7} {'median x':>9} {'rng x':>6} {'bound':>6} "
        f"{'scratch':>7} {'wire bytes':>12} {'bits/elem':>9}"
        + (f" {'loaded ms':>10} {'max ms':>8} {'slow-down':>9}" if competitor else "")
        + (f" {'vs quiet':>8}" if others else "")
        + (f" {'vs loaded':>9}" if others and competitor else "")
    )
    for n in SWEEP if args.sweep else args.sizes:
        tensor = torch.randn(max(1, n // 1000), min(n, 1000), generator=torch.Generator().manual_seed(0)).to(device)
        numel = tensor.numel()
        inner = max(1, SAMPLE_ELEMENTS // numel)
        target, out = torch.empty_like(tensor), torch.empty_like(tensor)

        def copy():
            target.copy_(tensor)

        copy_ms = min(interleaved([copy], device, args.repeats, inner, competitor)[0][0]) * 1e3  # quiet
        checked = numel >= CHECKED_FROM
        report(
            f"\n{numel} elements: copy_ {copy_ms:.4f} ms (min)"
            f"{'' if checked else ' (below the checked size: for reference)'}"
            f"{f'; a sample is the mean of {inner} calls' if inner > 1 else ''}\n{header}"
        )
        for name in grace_dgc.list_compressors(args.only):
            try:
                compressor = COMPRESSORS.get(name)(**PARAMS.get(name, {}))
                sent = roundtrip(compressor, tensor, out)
                impls = [("grace_dgc", lambda: roundtrip(compressor, tensor, out))]
                if baseline is not None and name in baseline.names("*"):
                    old = baseline.get(name)(**PARAMS.get(name, {}))
                    # the old revision's own data path: into the gradient where it has decompress_into (a
                    # fresh tensor per call would add its page faults, ~1 copy_, to the old side only)
                    if hasattr(old, "decompress_into"):
                        impls.append((args.baseline, lambda old=old: roundtrip(old, tensor, out)))
                    else:
                        impls.append((args.baseline, lambda old=old: returning_roundtrip(old, tensor)))
                if grace is not None and name in GRACE:
                    module, cls, kwargs = GRACE[name]
                    theirs = getattr(grace(module), cls)(**kwargs(compressor))
                    impls.append(("GRACE", lambda theirs=theirs: returning_roundtrip(theirs, tensor)))
                calls = [call for _, call in impls] + [copy]
                stochastic = isinstance(compressor, StochasticCompressor)
                if stochastic:  # its draw, timed in the same rounds
                    calls.append(rng_draw(numel, device, DRAWS.get(name, "uniforms")))
                quiet, loaded = interleaved(calls, device, args.repeats, inner, competitor, len(impls))
            except Exception as error:
                report(f"{name:<10} skipped: {type(error).__name__}: {error}")
                failures.append(f"{name}: {type(error).__name__}")
                continue
            copies = quiet[len(impls)]
            mine, mine_loaded = quiet[0], loaded[0] if loaded else []
            for at, (impl, _) in enumerate(impls):
                times = quiet[at]
                ratio = min(times) / min(copies)
                median = statistics.median(a / b for a, b in zip(times, copies))
                row = f"{name:<10} {impl:<9} {min(times) * 1e3:>8.3f} {ratio:>7.1f} {median:>9.1f} "
                flags = []
                if at == 0:
                    rng = min(quiet[-1]) / min(copies) if stochastic else 0.0
                    bound = EXCEPTIONS.get(name, TIME_BOUND) + rng
                    gradient_bytes = numel * tensor.element_size()
                    scratch = compressor.workspace.nbytes() / gradient_bytes
                    row += (
                        f"{f'{rng:.1f}' if stochastic else '':>6} {bound:>6.1f} {scratch:>7.2f} {sent:>12} "
                        f"{8 * sent / numel:>9.3f}"
                    )
                    scratch_bound = SCRATCH_GRADIENTS * gradient_bytes + SCRATCH_PER_WORKER * workers
                    if checked and (ratio > bound or compressor.workspace.nbytes() > scratch_bound):
                        flags.append("OVER")
                        failures.append(
                            f"{name} at {numel}: {ratio:.1f} x copy (bound {bound:.1f}), scratch "
                            f"{scratch:.2f} gradients (bound {SCRATCH_GRADIENTS} + 16 MiB × {workers} workers)"
                        )
                else:
                    row += f"{'':>6} {'':>6} {'':>7} {'':>12} {'':>9}"
                if competitor is not None:
                    busy = loaded[at]
                    slowdown = statistics.median(busy) / statistics.median(times)
                    row += f" {statistics.median(busy) * 1e3:>10.3f} {max(busy) * 1e3:>8.3f} {slowdown:>9.1f}"
                    if at == 0 and slowdown > LOAD_GOAL * NOISE:
                        flags.append("SLOW")
                        failures.append(f"{name} at {numel}: {slowdown:.1f}× slower under load (goal {LOAD_GOAL})")
                if others:
                    versus = min(times) / min(mine)
                    row += f" {'' if at == 0 else f'{versus:.2f}':>8}"
                    if at and versus * NOISE < 1:
                        flags.append("BEHIND")
                        failures.append(f"{name} at {numel}: {impl} {1 / versus:.2f}× faster, quiet")
                    if competitor is not None:
                        versus = statistics.median(loaded[at]) / statistics.median(mine_loaded)
                        row += f" {'' if at == 0 else f'{versus:.2f}':>9}"
                        if at and impl == "GRACE" and versus * NOISE < 1:
                            flags.append("BEHIND")
                            failures.append(f"{name} at {numel}: GRACE {1 / versus:.2f}× faster, loaded")
                report(row + "".join(f"  {flag}" for flag in flags))
    if failures:
        report("\nover the bound or behind: " + "; ".join(failures))
    elif args.check:
        report("\nevery method within its bound" + (" and the goals" if competitor or others else ""))
    return report, failures


if __name__ == "__main__":
    main()
