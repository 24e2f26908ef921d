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
    fn()    # warm-up: allocator, lazy initialisation
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)
