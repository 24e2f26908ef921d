"""Would the tests notice? One-line mutations of the data path and the parts, each run against a tier.

For each mutation: a copy of the working tree (the files git would check out, as CI's clone holds
them), the one line changed, then ``pytest --fast -x`` (or the whole suite with ``--tier full``) in
the copy. A mutation is *caught* when the tests fail. Issue 54's bar: the fast tier catches at
least 8 of these, the whole suite all of them. A mutation whose line is not found fails the run
(the code moved: update the table), so the check cannot pass by mutating nothing.

    python scripts/mutate.py                 # every mutation, fast tier
    python scripts/mutate.py --tier full --only 3,7
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file, the line as it is, the line mutated, what the mutation breaks)
MUTATIONS = [
    ("grace_dgc/grace.py", "out.div_(self.engine.size)", "out.div_(1)", "the average drops its ÷N"),
    (
        "grace_dgc/grace.py",
        "memory.update(c, n, comp, payload, ctx)",
        "pass",
        "error feedback never updates its memory",
    ),
    (
        "grace_dgc/memories/residual.py",
        "return residual.add_(tensor if self.gamma == 1 else self.gamma * tensor)",
        "return tensor if self.gamma == 1 else self.gamma * tensor",
        "the residual is not added back (compensate forgets the carried error)",
    ),
    (
        "grace_dgc/communicators/chunked.py",
        "return [numel * j // parts for j in range(parts + 1)]",
        "return [min(numel, numel * j // parts + (0 < j < parts)) for j in range(parts + 1)]",
        "an off-by-one in the chunks' bounds",
    ),
    (
        "grace_dgc/compressors/topk.py",
        "k = max(1, int(flat.numel() * self.compress_ratio)) if flat.numel() else 0",
        "k = max(1, int(flat.numel() * self.compress_ratio) - 1) if flat.numel() else 0",
        "top-k keeps one element fewer than its ratio",
    ),
    (
        "grace_dgc/compressors/sparse.py",
        "return tensor.sub_(payload[0].view(tensor.shape)) if sent_whole(ctx) else subtract_at_(tensor, payload)",
        "return tensor.sub_(payload[0].view(tensor.shape)) if sent_whole(ctx) else tensor",
        "a sparsifier's residual keeps what was sent",
    ),
    (
        "grace_dgc/compressors/signsgd.py",
        "return out.copy_(votes.mul_(2).sub_(len(payloads)).view(out.shape)).sign_()",
        "return out.copy_(votes.mul_(2).sub_(len(payloads) - 1).view(out.shape)).sign_()",
        "signSGD's majority vote miscounts the ranks",
    ),
    (
        "grace_dgc/compressors/fp16.py",
        "wire_dtype = torch.float16",
        "wire_dtype = torch.bfloat16",
        "fp16 sends another 16-bit format",
    ),
    (
        "grace_dgc/communicators/reduce_scatter.py",
        "                total.div_(n)",
        "                total.div_(n + 1)",
        "reduce-scatter's owner averages over the wrong count",
    ),
    (
        "grace_dgc/compressors/powersgd.py",
        "return torch.linalg.qr(matrix).Q",
        "return matrix",
        "PowerSGD skips its orthogonalisation",
    ),
    (
        "grace_dgc/memories/momentum.py",
        "max_norm = self.gradient_clipping / math.sqrt(self.world_size)",
        "max_norm = self.gradient_clipping",
        "DGC's local clipping forgets the 1/sqrt(N) of the paper",
    ),
    (
        "grace_dgc/compressors/sparse.py",
        "return [flat.index_select(0, indices), indices.to(torch.int32)]",
        "return [flat.index_select(0, indices), indices.flip(0).to(torch.int32)]",
        "the sparse wire format's values and indices out of step",
    ),
]


def copy_tree(target: str) -> None:
    """The files git would check out (tracked, and new ones not ignored): what CI's clone holds,
    so a test that reads any of them (.ci/run, the Makefile, the docs) reads them in the copy too."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):  # a deleted, not yet committed file is listed too
            os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(target, name))


def mutate(target: str, path: str, line: str, mutated: str) -> None:
    file = os.path.join(target, path)
    text = open(file).read()
    if text.count(line) != 1:
        raise SystemExit(f"mutate: {path}: {line!r} found {text.count(line)} times (1 expected): update MUTATIONS")
    open(file, "w").write(text.replace(line, mutated))


def pytest_in(target: str, tier: str, timeout: float) -> tuple[str, float, str]:
    """Run the tier in ``target``: ("failed" | "passed" | "hung" | "broken", seconds, last line).
    Only failing tests count as a catch: pytest's exit status 1. A collection or usage error
    (2-4) is "broken", the copy's fault, never a catch."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--no-header"]
    cmd += ["--fast"] if tier == "fast" else []
    env = dict(os.environ, PYTHONPATH=target, GRACE_PROPERTY_EXAMPLES=os.environ.get("GRACE_PROPERTY_EXAMPLES", "20"))
    where = subprocess.run(
        [sys.executable, "-c", "import grace_dgc; print(grace_dgc.__file__)"],
        cwd=target,
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not where.startswith(target):  # an installed grace_dgc would be tested, not the mutant
        raise SystemExit(f"mutate: the copy imports grace_dgc from {where!r}, not {target!r}")
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=target, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hung", time.monotonic() - started, f"no verdict within {timeout:.0f} s"
    verdict = {0: "passed", 1: "failed"}.get(done.returncode, "broken")
    lines = [line for line in done.stdout.strip().splitlines() if line.startswith(("FAILED", "ERROR"))]
    last = (lines or done.stdout.strip().splitlines()[-1:] or [""])[0]
    return verdict, time.monotonic() - started, last


def run(tier: str, only: set[int] | None, timeout: float, baseline: bool) -> int:
    if baseline:  # the unmutated copy must pass, or a catch means nothing
        with tempfile.TemporaryDirectory(prefix="grace_mutant_") as target:
            copy_tree(target)
            verdict, seconds, last = pytest_in(target, tier, timeout)
        print(f" 0. the unmutated copy: {verdict} in {seconds:5.0f} s  [{last[:110]}]", flush=True)
        if verdict != "passed":
            raise SystemExit("mutate: the unmutated copy does not pass its tier: fix that first")
    caught = 0
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1) if only is None or i in only]
    for i, (path, line, mutated, what) in chosen:
        with tempfile.TemporaryDirectory(prefix="grace_mutant_") as target:
            copy_tree(target)
            mutate(target, path, line, mutated)
            verdict, seconds, last = pytest_in(target, tier, timeout)
        if verdict == "broken":
            raise SystemExit(f"mutate: mutation {i} broke the copy, not a test ({last}): fix MUTATIONS")
        caught += verdict != "passed"  # a hang fails CI too
        print(
            f"{i:2d}. {'caught' if verdict != 'passed' else 'MISSED'} ({verdict}) in {seconds:5.0f} s  {path}: {what}"
        )
        print(f"      [{last[:110]}]", flush=True)
    print(f"mutate: the {tier} tier caught {caught} of {len(chosen)}")
    return caught


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=("fast", "full"), default="fast")
    parser.add_argument("--only", help="comma-separated mutation numbers (1-based)")
    parser.add_argument("--at-least", type=int, help="exit 1 when fewer are caught (default: all for full, 8 for fast)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated copy's run")
    args = parser.parse_args()
    only = {int(x) for x in args.only.split(",")} if args.only else None
    caught = run(args.tier, only, args.timeout, baseline=not args.no_baseline)
    total = len(only) if only else len(MUTATIONS)
    bar = args.at_least if args.at_least is not None else (total if args.tier == "full" or only else min(8, total))
    sys.exit(0 if caught >= bar else 1)


if __name__ == "__main__":
    main()
