"""Prove the CUDA/NCCL path in one command and write one report (issue 22).

    make gpu-check                      # on a machine with a GPU: venv (TORCH=cu128 by default there) + this
    python scripts/gpu_check.py [--device cuda|cpu] [--out REPORT.md] [--step-timeout S]
                                [--budget S] [--steps 1,3-5]

Steps, each in its own process group under a time limit (a step that hangs is killed and
reported as such, and the check goes on to the next):

  1. the CUDA tests (tests/core/test_cuda.py: the device fixture on cuda, NCCL, streams, the DDP
     hook on a CUDA bucket, CUDA random streams across ranks, peak CUDA memory of a step;
     tests/core/test_kernels.py: the fused Triton kernels compiled, bit for bit against the torch path);
  2. benchmarks/bench_kernels.py (each fused kernel against the torch ops it replaces);
  3. benchmarks/bench_compressors.py --device cuda (compress+decompress as a multiple of one
     copy_), with the fused kernels (the default) and
  4. with torch ops only (GRACE_DGC_KERNELS=torch), side by side;
  5. benchmarks/bench_dgc.py --device cuda;
  6. benchmarks/bench_overhead.py --backend nccl (DDP's allreduce vs DistributedOptimizer vs the
     DDP hook, one rank per GPU);
  7. the same on a host-bound model (24 narrow layers: the ratios are host work per tensor and
     per group, which a CPU run of the same shape shows too: 1.57x DDP on 2 cores);
  8. a short DGC-vs-dense training survey on CUDA (benchmarks/configs/gpu-check.toml);
  9. benchmarks/profile_cuda.py on the dense step (DDP, DistributedOptimizer, the DDP hook):
     torch.profiler's top ops and grace's phase times per step, for the overhead steps 6-7 show.

The whole check stops starting steps at ``--budget`` seconds (default 570: it fits a
10-minute slot on a lent machine), each step's limit cut to what is left; steps left out are
listed in the report with the ``--steps`` that runs them.

The report (markdown: device, driver, torch/CUDA/NCCL versions, every step's command, exit
status, seconds and output) goes to ``--out``, by default docs/results/gpu-check-<device>.md.
The exit status is 1 if any step failed. ``--device cpu`` is the dry run CI keeps working: the
same steps on tiny sizes, the GPU-only tests skipping with their reason.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_LINES = 160  # per step in the report; the whole output when shorter


def environment(device):
    """The machine and software the figures were taken on, as markdown lines."""
    import torch

    lines = [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- host: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPU cores",
        f"- Python {platform.python_version()}, torch {torch.__version__}",
    ]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        changed = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        dirty = " + uncommitted changes" if changed.stdout.strip() else ""
        lines.append(f"- grace_dgc commit: {commit.stdout.strip() or 'unknown (not a git checkout)'}{dirty}")
    except OSError:
        pass
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "absent"
        lines += [
            f"- GPU: {torch.cuda.device_count()} × {props.name}, {props.total_memory / 2**30:.0f} GiB, "
            f"{props.multi_processor_count} SMs, compute capability {props.major}.{props.minor}",
            f"- CUDA (torch's build) {torch.version.cuda}, NCCL {nccl}, cuDNN {torch.backends.cudnn.version()}",
        ]
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        if smi.returncode == 0:
            lines.append(f"- driver {smi.stdout.strip().splitlines()[0]}")
    else:
        lines.append("- device: CPU (dry run: tiny sizes; the GPU-only tests skip)")
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed (the fused kernels are off: the torch ops run)"
    lines.append(f"- Triton {triton}")
    return lines


TORCH_OPS_ONLY = {"GRACE_DGC_KERNELS": "torch"}
# 24 layers 64 wide: arithmetic negligible, so the ratios to DDP are per-tensor and per-group host work
HOST_BOUND_WIDTHS = ["64"] * 24 + ["10"]
TESTS = [
    "tests/core/test_cuda.py",
    "tests/core/test_kernels.py",
    "tests/core/test_randomk.py",
    "tests/training/test_fsdp.py::test_fsdp_on_cuda_none_is_fsdp_bit_for_bit_and_compressed_runs_stay_in_sync",
]


def steps(device, gpus, scratch):
    """(title, argv, extra environment) per step; sizes cut to a dry run on the CPU."""
    py = sys.executable
    survey_config = ROOT / "benchmarks/configs/gpu-check.toml"
    # -rsfE: the failures are named last, in the tail of the output the report keeps
    pytest = [py, "-m", "pytest", "-q", "-rsfE", "--tb=short", "-p", "no:cacheprovider", *TESTS]
    if device == "cuda":
        compressors = [py, "benchmarks/bench_compressors.py", "--device", "cuda"]
        return [
            ("CUDA tests", pytest),
            ("fused kernels vs torch ops", [py, "benchmarks/bench_kernels.py", "--device", "cuda"]),
            ("compress + decompress vs copy_", compressors),
            ("compress + decompress vs copy_, torch ops only", compressors, TORCH_OPS_ONLY),
            ("DGC selection", [py, "benchmarks/bench_dgc.py", "--device", "cuda"]),
            (
                "dense-path overhead on NCCL",
                [py, "benchmarks/bench_overhead.py", "--backend", "nccl", "--ranks", str(gpus), "--steps", "30"]
                + ["--repeats", "2"],
            ),
            (
                "dense-path overhead, host-bound (48 small tensors)",
                [py, "benchmarks/bench_overhead.py", "--backend", "nccl", "--ranks", str(gpus), "--steps", "50"]
                + ["--repeats", "2", "--batch", "8", "--widths", *HOST_BOUND_WIDTHS],
            ),
            (
                "DGC vs dense training",
                [py, "-m", "grace_dgc.cli", "survey", "--config", str(survey_config)]
                + ["--out", str(scratch / "survey"), "--no-progress"],
            ),
            (
                "where the dense step's time goes",
                [py, "benchmarks/profile_cuda.py", "--only", "", "--steps", "10", "--out", str(scratch)],
            ),
        ]
    dry_config = scratch / "gpu-check-cpu.toml"
    dry_config.write_text(survey_config.read_text().replace('device = "cuda"', 'device = "cpu"'))
    compressors = [py, "benchmarks/bench_compressors.py", "--device", "cpu", "--sizes", "20000", "--repeats", "1"]
    return [
        ("CUDA tests", [*pytest, "--collect-only"]),  # the suite runs them on the CPU already; here the command
        (
            "fused kernels vs torch ops",
            # two ops: Triton's interpreter takes 1 s an op whatever the size (the kernels' tests cover them all)
            [py, "benchmarks/bench_kernels.py", "--device", "cpu", "--sizes", "20000", "--repeats", "1"]
            + ["--ops", "pack_signs", "select"],
        ),
        ("compress + decompress vs copy_", compressors),
        ("compress + decompress vs copy_, torch ops only", compressors, TORCH_OPS_ONLY),
        ("DGC selection", [py, "benchmarks/bench_dgc.py", "--device", "cpu", "--sizes", "20000", "--repeats", "1"]),
        (
            "dense-path overhead on gloo",
            [py, "benchmarks/bench_overhead.py", "--backend", "gloo", "--ranks", "1", "--steps", "2"]
            + ["--repeats", "1", "--batch", "4", "--widths", "256", "512", "10"],  # not the 25.2M-parameter MLP
        ),
        (
            "dense-path overhead, host-bound (48 small tensors)",
            [py, "benchmarks/bench_overhead.py", "--backend", "gloo", "--ranks", "1", "--steps", "2"]
            + ["--repeats", "1", "--batch", "4", "--widths", *HOST_BOUND_WIDTHS],
        ),
        (
            "DGC vs dense training",
            [py, "-m", "grace_dgc.cli", "survey", "--config", str(dry_config)]
            + [
                "--out",
                str(scratch / "survey"),
                "--no-progress",
                "--workers",
                "1",
                "--epochs",
                "1",
                "--max-steps",
                "3",
            ],
        ),
        (
            "where the dense step's time goes",
            [py, "benchmarks/profile_cuda.py", "--device", "cpu", "--only", "", "--steps", "2"]
            + ["--widths", "64", "64", "10", "--out", str(scratch)],
        ),
    ]


def run_step(argv, timeout, extra_env=None):
    """(exit status or 'timeout', seconds, output); the step's whole process group is killed
    at the limit, so a hung collective ends here instead of hanging the check."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(extra_env or {}),
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        status: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = "timeout"
    return status, time.monotonic() - start, output


def shown(argv, extra_env=None):
    """The command as a user would type it from the repository's root."""
    words = [f"{k}={v}" for k, v in (extra_env or {}).items()]
    words += [
        "python" if a == sys.executable else os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a for a in argv
    ]
    return " ".join(words)


def chosen_steps(text, count):
    """``--steps`` ("1,3-5") as a sorted list of 1-based step numbers, checked against ``count``."""
    if text is None:
        return list(range(1, count + 1))
    numbers = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            span = range(int(low), int(high or low) + 1)
        except ValueError:
            raise SystemExit(f"--steps {text!r}: expected numbers and ranges like 1,3-5") from None
        if not span or span[0] < 1 or span[-1] > count:
            raise SystemExit(f"--steps {text!r}: steps are numbered 1 to {count}")
        numbers.update(span)
    return sorted(numbers)


def trimmed(output):
    lines = output.rstrip().splitlines()
    if len(lines) <= OUTPUT_LINES:
        return "\n".join(lines)
    return "\n".join([f"[... {len(lines) - OUTPUT_LINES} earlier lines left out ...]"] + lines[-OUTPUT_LINES:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--out", type=Path, help="the report (default: docs/results/gpu-check-<device>.md)")
    parser.add_argument("--step-timeout", type=float, default=300.0, help="seconds before a step is killed")
    parser.add_argument(
        "--budget", type=float, default=570.0, help="seconds for the whole check: no step starts after (0: no limit)"
    )
    parser.add_argument("--steps", help="which steps to run, by number (e.g. 1,3-5; default: all)")
    args = parser.parse_args(argv)
    import torch

    if args.device is None and not torch.cuda.is_available() and shutil.which("nvidia-smi"):
        parser.error(
            f"nvidia-smi is here but torch {torch.__version__} sees no GPU (a CPU build?): install a CUDA build "
            "(make gpu-check TORCH=cu128 in a fresh venv), or pass --device cpu for the dry run"
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda, but torch {torch.__version__} sees no GPU (a CPU build, or no driver)")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") if gpus else "cpu-dry-run"
    out = args.out or ROOT / "docs" / "results" / f"gpu-check-{name}.md"

    report = [f"# GPU check: {name}", "", *environment(device), ""]
    summary, details, failed = [], [], 0
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        planned = steps(device, gpus, Path(scratch))
        wanted = chosen_steps(args.steps, len(planned))
        left_out = []
        for number in wanted:
            title, step, extra_env = (*planned[number - 1], None)[:3]
            remaining = args.budget - (time.monotonic() - started) if args.budget else float("inf")
            if remaining < 10:
                left_out.append(number)
                summary.append(f"| {number}. {title} | not run: the --budget of {args.budget:.0f} s was spent | 0 |")
                continue
            print(f"== {number}. {title}: {shown(step, extra_env)}", flush=True)
            status, seconds, output = run_step(step, min(args.step_timeout, remaining), extra_env)
            ok = status == 0
            failed += not ok
            verdict = (
                "passed" if ok else ("killed at the time limit" if status == "timeout" else f"FAILED (exit {status})")
            )
            print(f"   {verdict} in {seconds:.0f} s", flush=True)
            if not ok:
                print(trimmed(output)[-4000:], flush=True)
            summary.append(f"| {number}. {title} | {verdict} | {seconds:.0f} |")
            written = Path(scratch) / "survey" / "report.md"
            if "survey" in step and written.exists():  # the survey's own summary tables
                output += "\n\n" + "\n".join(written.read_text().splitlines()[: OUTPUT_LINES // 2])
            details += [
                f"## {number}. {title}",
                "",
                f"`{shown(step, extra_env)}` — {verdict} in {seconds:.0f} s",
                "",
                "```",
                trimmed(output),
                "```",
                "",
            ]
            # written after every step: a check cut short still leaves what it measured
            table = ["| step | result | seconds |", "| --- | --- | --- |", *summary, ""]
            out.write_text("\n".join(report + table + details))
        if left_out:
            rest = ",".join(map(str, left_out))
            note = (
                f"Steps {rest} were not run within the budget: `python scripts/gpu_check.py --steps {rest}` runs them."
            )
            table = ["| step | result | seconds |", "| --- | --- | --- |", *summary, "", note, ""]
            out.write_text("\n".join(report + table + details))
            print(note)
    print(f"report: {out} ({failed} of {len(summary) - len(left_out)} steps failed, {len(left_out)} not run)")
    return 1 if failed or left_out else 0


if __name__ == "__main__":
    sys.exit(main())
