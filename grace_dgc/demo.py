"""A small, complete distributed training run per method on generated data (no files)."""

import torch

import grace_dgc
from grace_dgc.launch import run_local

DEFAULT_PARAMS = {
    "topk": {"compress_ratio": 0.01},
    "randomk": {"compress_ratio": 0.01},
    "threshold": {"threshold": 0.01},
    "dgc": {"compress_ratio": 0.01},
}


def make_data(seed=0, n=2048, dim=32, classes=4):
    """A seeded teacher task: labels from a random linear map of Gaussian inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    y = (x @ torch.randn(dim, classes, generator=gen)).argmax(dim=1)
    return x, y


def train(rank, world_size, compressor, memory, steps, seed=0):
    """Train an MLP for ``steps`` on this rank's shard; returns final loss and wire stats."""
    x, y = make_data(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    comm = "allreduce" if grace_dgc.registry.COMPRESSORS.get(compressor).summable else "allgather"
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


def run_demo(methods, workers=2, steps=60):
    print(f"{'method':24} {'final loss':>10} {'bytes/step':>12} {'ratio':>8}")
    for parts in methods:
        compressor, memory = parts[0], (parts[1] if len(parts) > 1 else "none")
        stats = run_local(train, workers, (compressor, memory, steps))[0]
        print(
            f"{compressor + '+' + memory:24} {stats['loss']:10.4f} "
            f"{stats['bytes_per_step']:12.0f} {stats['compression_ratio']:8.4f}"
        )
