"""Overhead of grace_dgc's dense path against DDP's own allreduce: step time and peak memory.

    .venv/bin/python benchmarks/bench_overhead.py [--ranks 2] [--steps 20] [--repeats 3]
        [--batch 32] [--backend gloo|nccl] [--memory-case] [--widths 64 64 ... 10]

Each run spawns ``--ranks`` processes (gloo on localhost, one intra-op thread per rank on a
2-core machine; NCCL with ``--backend nccl``, one GPU per rank or ranks sharing one) that
train the same MLP, 1024-4096-4096-1024-10 (25.2M parameters; ``--widths`` gives others), on
the same random batches with SGD, in one of these modes:

  ddp        DistributedDataParallel with its built-in allreduce (the reference);
  optimizer  ``grace_dgc.DistributedOptimizer`` with ``none`` + ``allreduce``;
  hook       DDP with ``grace_dgc.ddp_comm_hook`` and ``none`` + ``allreduce``;
  torch-hook DDP with torch's own ``allreduce_hook`` (a reference: what any Python comm hook costs).

``--adam`` runs the Adam schedules (issue 40) against DDP with AdamW instead, every mode on
``torch.optim.AdamW``:

  ddp-adamw  DistributedDataParallel with AdamW (the reference);
  1bit-warm  ``onebit_adam`` in its dense warm-up (an fp32 allreduce, then its own Adam step);
  1bit       ``onebit_adam`` after the freeze: the momentum through efsignsgd(rms) + residual +
             reduce_scatter (the papers' compressed allreduce), every step;
  01adam     ``zero_one_adam`` after the variance freeze, synchronizing every step (H = 1: its
             most expensive steps; later ones are local and send nothing).
The first 3 steps (untimed) are the warm-up of ``1bit`` and the variance steps of ``01adam``.

``--fsdp`` runs FSDP2 (issue 42: every Linear and the model ``fully_shard``-ed over the ranks)
against plain FSDP2, every mode on SGD:

  fsdp        plain ``fully_shard`` (the reference);
  fsdp-none   ``fsdp_compression`` with ``none``: FSDP's own reduce-scatter behind grace's hook;
  torch-bf16  ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``: torch's own bf16 reduction;
  fsdp-bf16   ``fsdp_compression`` with ``bf16`` on the reduce-scatter;
  fsdp-fp8    ``fsdp_compression`` with ``fp8`` (e4m3, a scale per 256) on the reduce-scatter.

Per run: the median step time (zero_grad, forward, backward, exchange, step) over ``--steps``
steps after 3 warm-up steps, and the peak resident memory (``ru_maxrss``) of the process; the
slowest rank counts. Modes run in fresh processes, interleaved (ddp, optimizer, hook, ddp, …)
``--repeats`` times, so all see the same machine; the table gives each mode's minimum over
the repeats (the least disturbed) and its ratio to ddp's.

``--memory-case`` adds the issue's memory case: one 50M-element parameter (a 7072×7072
weight, y = x·W, 200 MB of fp32 gradient), 3 steps, peak memory of plain
``torch.distributed.all_reduce`` on the gradient against grace methods through
``DistributedOptimizer``; ``extra`` is the excess over plain allreduce in gradients (200 MB).

A host-bound case, on a CPU: ``--widths`` with many narrow layers (e.g. ``--widths`` 64 ×24
then 10: 47 tensors of ≤ 4K elements, 0.1M parameters) makes the arithmetic negligible, so
the ratios show the per-step and per-tensor host work of each mode — what a GPU, where the
arithmetic is fast, shows for any model (docs/results/README.md: the communication thread
was host-bound on an H100).
"""

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import Report, shown_argv

import grace_dgc
from grace_dgc.launch import run_local

WIDTHS = (1024, 4096, 4096, 1024, 10)
MODES = ("ddp", "optimizer", "hook", "torch-hook")
FSDP_MODES = ("fsdp", "fsdp-none", "torch-bf16", "fsdp-bf16", "fsdp-fp8")
ADAM_MODES = ("ddp-adamw", "1bit-warm", "1bit", "01adam")
ONE_BIT = ("efsignsgd", "residual", "reduce_scatter")
MEMORY_METHODS = (
    ("allreduce", None),
    ("none", ("none", "none", "allreduce", {})),
    ("topk+residual", ("topk", "residual", "allgather", {"compress_ratio": 0.01})),
    ("dgc+momentum", ("dgc", "momentum", "allgather", {"compress_ratio": 0.001})),
)


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mlp(widths=WIDTHS):
    torch.manual_seed(0)
    layers = []
    for i in range(len(widths) - 1):
        layers += [torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def device_of(rank):
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def train_job(rank, world_size, mode, steps, batch, widths=WIDTHS):
    device = device_of(rank)
    model = mlp(widths).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if mode in ADAM_MODES:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode in ("1bit-warm", "1bit", "01adam"):
        grace = grace_dgc.build(*ONE_BIT, scale="rms")
        name, settings = {
            "1bit-warm": ("onebit_adam", {"freeze_step": 10**9}),
            "1bit": ("onebit_adam", {"freeze_step": 3}),
            "01adam": ("zero_one_adam", {"var_freeze_step": 3, "local_step_scaler": 10**9}),
        }[mode]
        optimizer = grace_dgc.schedules.create(name, optimizer, grace, model.named_parameters(), **settings)
    elif mode in FSDP_MODES:
        model = sharded(model, mode)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    elif mode == "ddp-adamw":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "optimizer":
        grace = grace_dgc.build("none", "none", "allreduce")
        optimizer = grace_dgc.DistributedOptimizer(optimizer, grace, model.named_parameters())
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if mode == "hook":
            state, hook = grace_dgc.ddp_comm_hook(grace_dgc.build("none", "none", "allreduce"), model)
            model.register_comm_hook(state, hook)
        elif mode == "torch-hook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            model.register_comm_hook(None, allreduce_hook)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps + 3):
        x = torch.randn(batch, widths[0], generator=generator).to(device)
        y = torch.randint(0, widths[-1], (batch,), generator=generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= 3:
            times.append(time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_mb()
    return statistics.median(times), memory


def sharded(model, mode):
    """``model`` under FSDP2 as ``mode`` says (see --fsdp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_of(0).type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if mode == "torch-bf16" else None)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    compressor = {"fsdp-none": "none", "fsdp-bf16": "bf16", "fsdp-fp8": "fp8"}.get(mode)
    if compressor:
        grace_dgc.fsdp_compression(model, reduce_scatter=grace_dgc.build(compressor, "none", "reduce_scatter"))
    return model


def memory_job(rank, world_size, method, steps):
    """Peak memory of one 50M-element parameter's exchange: plain allreduce or a grace method."""
    device = device_of(rank)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(7072, 7072, device=device) * 1e-3)
    optimizer = torch.optim.SGD([weight], lr=0.01)
    spec = dict(MEMORY_METHODS)[method]
    if spec is not None:
        comp, mem, comm, params = spec
        optimizer = grace_dgc.DistributedOptimizer(
            optimizer, grace_dgc.build(comp, mem, comm, **params), [("w", weight)]
        )
    x = torch.randn(8, 7072, device=device)
    for _ in range(steps):
        optimizer.zero_grad()
        (x @ weight).square().mean().backward()
        if spec is None:
            torch.distributed.all_reduce(weight.grad)
            weight.grad /= world_size
        optimizer.step()
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_mb()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--memory-case", action="store_true")
    parser.add_argument("--adam", action="store_true", help="the Adam schedules against DDP with AdamW")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 with grace's reduce-scatter against plain FSDP2")
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="the MLP's layer widths")
    parser.add_argument("--readme", metavar="PATH", help="also write the figures into PATH's block for this script")
    args = parser.parse_args(argv)
    report = Report()
    widths = tuple(args.widths)
    if len(widths) < 2 or min(widths) < 1:
        parser.error(f"--widths {args.widths}: at least two positive layer widths")
    unit = "peak GPU MB" if args.backend == "nccl" else "peak RSS MB"
    report(
        f"torch {torch.__version__}, {args.ranks} {args.backend} ranks, MLP {'-'.join(map(str, widths))} "
        f"({sum(p.numel() for p in mlp(widths).parameters()) / 1e6:.1f}M parameters), batch {args.batch}, "
        f"{args.steps} steps per run, {args.repeats} interleaved repeats"
    )
    modes = ADAM_MODES if args.adam else FSDP_MODES if args.fsdp else MODES
    runs = {mode: [] for mode in modes}
    for repeat in range(args.repeats):  # --repeats 0: the memory case only
        for mode in modes:
            job = (mode, args.steps, args.batch, widths)
            per_rank = run_local(train_job, args.ranks, job, backend=args.backend)
            seconds, memory = max(r[0] for r in per_rank), max(r[1] for r in per_rank)
            runs[mode].append((seconds, memory))
            report(f"  repeat {repeat + 1} {mode:<10} {seconds * 1e3:7.1f} ms/step  {memory:7.0f} {unit}", flush=True)
    if args.repeats:
        base_time = min(t for t, _ in runs[modes[0]])
        base_memory = min(m for _, m in runs[modes[0]])
        ref = f"x {'fsdp' if args.fsdp else 'ddp'}"
        report(f"\n{'mode':<11} {'ms/step':>8} {ref:>6} {unit:>12} {ref:>6}   (minimum over repeats)")
        for mode in modes:
            seconds, memory = min(t for t, _ in runs[mode]), min(m for _, m in runs[mode])
            report(
                f"{mode:<11} {seconds * 1e3:>8.1f} {seconds / base_time:>6.3f} {memory:>12.0f} "
                f"{memory / base_memory:>6.3f}"
            )
    if args.memory_case:
        report(f"\none 50M-element parameter (200 MB gradient), {args.ranks} ranks, 3 steps: {unit}")
        baseline = None
        for method, _ in MEMORY_METHODS:
            memory = max(run_local(memory_job, args.ranks, (method, 3), backend=args.backend))
            baseline = memory if baseline is None else baseline
            report(f"{method:<14} {memory:>8.0f}   extra {(memory - baseline) / 200:>5.2f} gradients")
    if args.readme:
        report.write_readme(args.readme, "bench_overhead", shown_argv(argv))


if __name__ == "__main__":
    main()
