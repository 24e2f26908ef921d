"""Wall-clock timing shared by the benchmark scripts (device-synchronised)."""

import statistics
import time

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats):
    """(median, min) seconds of ``repeats`` calls after one warm-up call; the minimum is the
    least disturbed by other processes on a shared machine."""
    fn()  # warm-up: allocator, lazy initialisation
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def shown_argv(argv):
    """The arguments a benchmark ran with, less ``--readme PATH`` and ``--block NAME`` (for
    the figures page)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    for option in ("--readme", "--block"):
        if option in args:
            at = args.index(option)
            del args[at : at + 2]
    return args


class Report:
    """Prints lines as they come and keeps them, so a benchmark can also write them into a
    page's block, docs/performance.md (``--readme``)."""

    def __init__(self):
        self.lines = []

    def __call__(self, text="", **kwargs):
        print(text, **kwargs)
        self.lines.extend(str(text).split("\n"))

    def write_readme(self, path, key, argv, block=None):
        """Replace the block between ``<!-- BLOCK:begin -->`` and ``<!-- BLOCK:end -->`` in
        ``path`` (BLOCK: ``key``, the script's name, unless given) with the command line of
        ``benchmarks/KEY.py`` and the printed figures."""
        import shlex

        block = block or key
        begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if begin not in text or end not in text:
            raise SystemExit(f"{path} has no {begin} ... {end} block to write the figures into")
        command = " ".join(["python", f"benchmarks/{key}.py"] + [shlex.quote(a) for a in argv])
        figures = "\n".join([begin, "```", f"$ {command}", *self.lines, "```", end])
        head, rest = text.split(begin, 1)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(head + figures + rest.split(end, 1)[1])


COMPETITOR = """
import os, sys, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(25_000_000)
parent = os.getppid()
print("ready", flush=True)
while os.getppid() == parent:  # never outlives the benchmark, even one killed by SIGKILL
    (x.abs() > 0.5).sum()
"""


class Competitor:
    """Another process computing beside the benchmark, as real training always has company
    (data-loader workers, the backward pass, other ranks): a loop of abs/compare/sum over
    25M fp32 elements on ``threads`` torch intra-op threads. ``pause()``/``resume()``
    (SIGSTOP/SIGCONT) give quiet and loaded rounds in one run; ``stop()`` kills it by its own
    process id. A context manager: it never outlives the benchmark."""

    def __init__(self, threads):
        import subprocess
        import sys

        self.process = subprocess.Popen(
            [sys.executable, "-c", COMPETITOR, str(threads)], stdout=subprocess.PIPE, text=True
        )
        if self.process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the competing process did not start")
        self.running = True

    def pause(self):
        import signal

        if self.running:
            self.process.send_signal(signal.SIGSTOP)
            self.running = False
            time.sleep(0.05)  # let the scheduler notice

    def resume(self):
        import signal

        if not self.running:
            self.process.send_signal(signal.SIGCONT)
            self.running = True
            time.sleep(0.05)

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
