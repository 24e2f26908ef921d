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
    """The arguments a benchmark ran with, less ``--readme PATH`` (for the README)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if "--readme" in args:
        at = args.index("--readme")
        del args[at : at + 2]
    return args


class Report:
    """Prints lines as they come and keeps them, so a benchmark can also write them into the
    README's performance section (``--readme``)."""

    def __init__(self):
        self.lines = []

    def __call__(self, text="", **kwargs):
        print(text, **kwargs)
        self.lines.extend(str(text).split("\n"))

    def write_readme(self, path, key, argv):
        """Replace the block between ``<!-- KEY:begin -->`` and ``<!-- KEY:end -->`` in ``path``
        with the command line and the printed figures."""
        import shlex

        begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if begin not in text or end not in text:
            raise SystemExit(f"{path} has no {begin} ... {end} block to write the figures into")
        command = " ".join(["python", f"benchmarks/{key}.py"] + [shlex.quote(a) for a in argv])
        block = "\n".join([begin, "```", f"$ {command}", *self.lines, "```", end])
        head, rest = text.split(begin, 1)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(head + block + rest.split(end, 1)[1])
