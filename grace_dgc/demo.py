"""A small, complete distributed training run per method on generated data (no files)."""

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

import grace_dgc
from grace_dgc.errors import GraceConfigError
from grace_dgc.launch import RankPool

DEFAULT_PARAMS = {
    "topk": {"compress_ratio": 0.01},
    "randomk": {"compress_ratio": 0.01},
    "threshold": {"threshold": 0.01},
    "dgc": {"compress_ratio": 0.01},
}


def _communicator(compressor: str) -> str:
    return "allreduce" if grace_dgc.registry.COMPRESSORS.get(compressor).summable else "allgather"


def plan(methods: str, workers: int = 2, steps: int = 60) -> list[list[str]]:
    """The ``[compressor, memory]`` pairs of a ``--methods`` text (``compressor[:memory],...``),
    canonical names, each built on paper for ``workers`` ranks as :func:`train` builds it: a bad
    name, combination or count is a :class:`GraceConfigError` before any rank starts."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise GraceConfigError(f"--workers {workers!r} must be an int >= 1 (ranks started on this machine)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise GraceConfigError(f"--steps {steps!r} must be an int >= 1")
    from grace_dgc.engines.local import PlanEngine

    pairs = []
    for item in methods.split(","):
        parts = [part.strip() for part in item.split(":")]
        if len(parts) > 1 and (parts[0].endswith(".py") or "." in parts[0] or "/" in parts[0]):
            parts[:2] = [f"{parts[0]}:{parts[1]}"]  # your own class, file.py:Class or package.module:Class
        if len(parts) > 2 or not parts[0]:
            raise GraceConfigError(
                f"--methods item {item!r}: give compressor[:memory], e.g. topk:residual or my_methods.py:Mine:residual"
            )
        compressor = grace_dgc.registry.COMPRESSORS.canonical(parts[0])
        memory = grace_dgc.registry.MEMORIES.canonical(parts[1] if len(parts) == 2 else "none")
        params: dict = DEFAULT_PARAMS.get(compressor, {})
        try:
            grace_dgc.build(compressor, memory, _communicator(compressor), engine=PlanEngine(workers), **params)
        except GraceConfigError as err:
            raise GraceConfigError(f"--methods item {item!r} on {workers} workers: {err}") from None
        pairs.append([compressor, memory])
    return pairs


def make_data(seed: int = 0, n: int = 2048, dim: int = 32, classes: int = 4) -> tuple[Tensor, Tensor]:
    """A seeded teacher task: labels from a random linear map of Gaussian inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    y = (x @ torch.randn(dim, classes, generator=gen)).argmax(dim=1)
    return x, y


def train(rank: int, world_size: int, compressor: str, memory: str, steps: int, seed: int = 0) -> dict[str, Any]:
    """Train an MLP for ``steps`` on this rank's shard; returns final loss and wire stats."""
    x, y = make_data(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    comm = _communicator(compressor)
    params: dict = DEFAULT_PARAMS.get(compressor, {})
    grace = grace_dgc.build(compressor, memory, comm, **params)
    opt = grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace, model.named_parameters())
    batch = 64
    for step in range(steps):
        start = (step * batch * world_size + rank * batch) % (len(x) - batch)
        loss = torch.nn.functional.cross_entropy(model(x[start : start + batch]), y[start : start + batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        full_loss = torch.nn.functional.cross_entropy(model(x), y).item()
    return {"loss": full_loss, **grace.stats()}


def run_demo(methods: Sequence[Sequence[str]], workers: int = 2, steps: int = 60) -> None:
    """Train each method on ``workers`` local gloo ranks (started once, kept up across the
    methods) and print its row as it finishes: the method's name as it starts (flushed, so a
    terminal or a log shows which one runs), then its loss, bytes, ratio and seconds."""
    print(
        f"{len(methods)} method(s), {steps} steps each, on {workers} gloo rank(s) on this machine "
        "(started once: the first method waits for them)",
        flush=True,
    )
    print(f"{'method':24} {'final loss':>10} {'bytes/step':>12} {'ratio':>8} {'seconds':>8}", flush=True)
    with RankPool(workers) as pool:
        for parts in methods:
            compressor, memory = parts[0], (parts[1] if len(parts) > 1 else "none")
            print(f"{compressor + '+' + memory:24} ", end="", flush=True)
            started = time.perf_counter()
            stats = pool.run(train, (compressor, memory, steps))[0]
            print(
                f"{stats['loss']:10.4f} {stats['bytes_per_step']:12.0f} {stats['compression_ratio']:8.4f} "
                f"{time.perf_counter() - started:8.1f}",
                flush=True,
            )
