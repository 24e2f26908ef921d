"""Where the GPU time goes: torch.profiler over compress+decompress of the methods that miss
their bound, and over the dense path's step (DistributedOptimizer and the DDP hook against
plain DDP) on one NCCL rank. Prints the top kernels/ops, grace's own phase times per step
(what the communication thread spent compressing, communicating, ... and what the training
thread waited for it), and writes Chrome traces.

    python benchmarks/profile_cuda.py [--out DIR] [--only 'topk,randomk'] [--steps 10]
        [--widths 64 64 ... 10] [--device cuda|cpu]

``--only ''`` profiles the steps alone; ``--device cpu`` is the dry run (gloo, CPU activity).
"""

import argparse
import fnmatch
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grace_dgc, uninstalled
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the other benchmarks

import grace_dgc
from grace_dgc.registry import COMPRESSORS


def activities(device):
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PARAMS = {"topk": {"compress_ratio": 0.01}, "randomk": {"compress_ratio": 0.01}, "dgc": {"compress_ratio": 0.001}}


def compressors(pattern, numel, out, device):
    x = torch.randn(numel // 1000, 1000, device=device)
    into = torch.empty_like(x)
    for name in grace_dgc.list_compressors():
        if not any(fnmatch.fnmatch(name, p) for p in pattern.split(",") if p):
            continue
        comp = COMPRESSORS.get(name)(**PARAMS.get(name, {}))

        def once():
            payload, ctx = comp.compress(x, "w")
            while comp.rounds > 1:
                following = comp.next_round(payload, ctx)
                if following is None:
                    break
                payload, ctx = following
            comp.decompress_into(payload, ctx, into)

        for _ in range(3):
            once()
        synchronize(device)
        with profile(activities=activities(device)) as prof:
            for _ in range(5):
                once()
            synchronize(device)
        print(f"\n===== {name}: 5 × compress+decompress_into of {numel} fp32")
        order = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=order, row_limit=14, max_name_column_width=60))
        prof.export_chrome_trace(os.path.join(out, f"compress-{name}.json"))


def step_job(rank, world_size, mode, steps, out, widths):
    from bench_overhead import mlp

    device = torch.device("cuda", 0) if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    model = mlp(widths).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    grace = grace_dgc.build("none", "none", "allreduce")
    if mode == "optimizer":
        optimizer = grace_dgc.DistributedOptimizer(optimizer, grace, model.named_parameters())
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if mode == "hook":
            model.register_comm_hook(*grace_dgc.ddp_comm_hook(grace, model))
    x = torch.randn(32, widths[0], device=device)
    y = torch.randint(0, widths[-1], (32,), device=device)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(5):
        step()
    synchronize(device)
    grace.reset_stats()
    with profile(activities=activities(device)) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    prof.export_chrome_trace(os.path.join(out, f"step-{mode}.json"))
    if mode != "ddp":  # grace's phases, per step (under the profiler, so slower than unprofiled)
        stats = grace.stats()
        phases = ("compress", "memory", "communicate", "decompress", "wait")
        table += f"\ngrace per step ({stats['groups'] / steps:.0f} groups): " + ", ".join(
            f"{phase} {stats[phase + '_seconds'] / steps * 1e3:.3f} ms" for phase in phases
        )
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--only", default="topk,randomk,onebit,terngrad,qsgd,natural,efsignsgd,signum,dgc,twobit")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--widths", type=int, nargs="+", default=None, help="the MLP's layer widths")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    compressors(args.only, args.numel, args.out, device)
    from bench_overhead import WIDTHS

    from grace_dgc.launch import run_local

    widths = tuple(args.widths or WIDTHS)
    backend = "nccl" if device.type == "cuda" else "gloo"
    for mode in ("ddp", "optimizer", "hook"):
        table = run_local(step_job, 1, (mode, args.steps, args.out, widths), backend=backend, timeout=200)[0]
        print(f"\n===== step, {mode}: {args.steps} steps of an MLP {'-'.join(map(str, widths))}, by self CPU time")
        print(table)


if __name__ == "__main__":
    main()
