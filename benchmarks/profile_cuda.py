"""Where the GPU time goes: torch.profiler over compress+decompress of the methods that miss
their bound, and over the dense path's step (DistributedOptimizer and the DDP hook against
plain DDP) on one NCCL rank. Prints the top kernels/ops and writes Chrome traces.

    python benchmarks/profile_cuda.py [--out DIR] [--only 'topk,randomk'] [--steps 10]
"""

import argparse
import fnmatch
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grace_dgc
from grace_dgc.registry import COMPRESSORS

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
PARAMS = {"topk": {"compress_ratio": 0.01}, "randomk": {"compress_ratio": 0.01}, "dgc": {"compress_ratio": 0.001}}


def compressors(pattern, numel, out):
    x = torch.randn(numel // 1000, 1000, device="cuda")
    into = torch.empty_like(x)
    for name in grace_dgc.list_compressors():
        if not any(fnmatch.fnmatch(name, p) for p in pattern.split(",")):
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
        torch.cuda.synchronize()
        with profile(activities=ACTIVITIES) as prof:
            for _ in range(5):
                once()
            torch.cuda.synchronize()
        print(f"\n===== {name}: 5 × compress+decompress_into of {numel} fp32")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        prof.export_chrome_trace(os.path.join(out, f"compress-{name}.json"))


def step_job(rank, world_size, mode, steps, out):
    from bench_overhead import WIDTHS, mlp

    device = torch.device("cuda", 0)
    model = mlp().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if mode == "optimizer":
        optimizer = grace_dgc.DistributedOptimizer(
            optimizer, grace_dgc.build("none", "none", "allreduce"), model.named_parameters()
        )
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if mode == "hook":
            model.register_comm_hook(*grace_dgc.ddp_comm_hook(grace_dgc.build("none", "none", "allreduce"), model))
    x = torch.randn(32, WIDTHS[0], device=device)
    y = torch.randint(0, WIDTHS[-1], (32,), device=device)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=ACTIVITIES) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    prof.export_chrome_trace(os.path.join(out, f"step-{mode}.json"))
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--only", default="topk,randomk,onebit,terngrad,qsgd,natural,efsignsgd,signum,dgc,twobit")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    compressors(args.only, args.numel, args.out)
    from grace_dgc.launch import run_local

    for mode in ("ddp", "optimizer", "hook"):
        table = run_local(step_job, 1, (mode, args.steps, args.out), backend="nccl", timeout=200)[0]
        print(f"\n===== step, {mode}: {args.steps} steps, sorted by self CPU time")
        print(table)


if __name__ == "__main__":
    main()
