r"""A GPT sharded with FSDP2 (torch's ``fully_shard``) under AdamW, its gradient reduction
compressed by grace_dgc; HSDP (shard 2 × replicate N/2) on 4 ranks or more.

    torchrun --nproc-per-node 2 examples/survey_fsdp.py --steps 20            # alone: fp8 reduce-scatter
    grace-dgc survey --script examples/survey_fsdp.py --config examples/survey_fsdp.toml \
        --out runs/fsdp --script-args --epochs 2

On a 1-D mesh the cell's method runs FSDP's reduce-scatter (its communicator is
``reduce_scatter``); under HSDP it runs the all-reduce of each shard across the replicas (any
composition), and FSDP's own reduce-scatter inside the shard group is counted beside it.
``--reduce-dtype bf16`` (or a method row's ``tags = {reduce_dtype = "bf16"}``) is torch's own anchor:
``MixedPrecisionPolicy(reduce_dtype=bfloat16)`` with FSDP's own reduce-scatter.
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import grace_dgc
import grace_survey as survey
from grace_survey.workloads.text import CharTransformer, corpus_text, encode, split_bounds, vocabulary, windows


def evaluate(model, inputs, targets, rank, world_size):
    """(mean cross-entropy per token, next-token accuracy) over every rank's share of windows."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, len(inputs), 64):  # every rank the same batches: FSDP's forward is collective
            logits = model(inputs[start : start + 64])
            y = targets[start : start + 64]
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            sums += torch.tensor([loss, (logits.argmax(-1) == y).sum().item(), y.numel()], dtype=torch.float64)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="steps per epoch (0: the whole text)")
    parser.add_argument("--batch", type=int, default=16, help="windows per rank and step")
    parser.add_argument("--train-chars", type=int, default=60000)
    parser.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    text = corpus_text()
    vocab = vocabulary(text)
    train_end, valid_end = split_bounds(len(text))
    x, y = windows(encode(text[:train_end][: args.train_chars], vocab), 64)
    x_test, y_test = windows(encode(text[valid_end:][:20000], vocab), 64)

    seed = survey.cell_seed()
    torch.manual_seed(seed)
    model = CharTransformer(len(vocab), 64, d_model=64, n_layer=2, n_head=4)
    hsdp = world >= 4 and world % 2 == 0
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    shard_mesh = mesh["shard"] if mesh is not None else init_device_mesh("cpu", (world,))
    settings = survey.cell()  # a method row's tags may ask for torch's own bf16 reduction (the anchor)
    reduce_dtype = (settings["method"]["tags"].get("reduce_dtype") if settings else None) or args.reduce_dtype
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if reduce_dtype == "bf16" else None)
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    if hsdp:  # the method on the replicas; FSDP's own reduce-scatter in the shard group, counted
        grace = survey.cell_grace(
            "topk", "residual", "allgather", compress_ratio=0.05, process_group=mesh["replicate"].get_group()
        )
        shard_grace = grace_dgc.build("none", "none", "reduce_scatter", process_group=shard_mesh.get_group())
        compression = grace_dgc.fsdp_compression(model, reduce_scatter=shard_grace, replicate=grace)
    else:
        grace = survey.cell_grace("fp8", "none", "reduce_scatter")
        compression = grace_dgc.fsdp_compression(model, reduce_scatter=grace)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)

    global_batch = args.batch * (world // 2 if hsdp else world)  # the data is split over the replicas
    data_rank = dist.get_rank(mesh["replicate"].get_group()) if hsdp else rank
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        steps = args.steps or len(x) // global_batch
        losses, started = [], time.perf_counter()
        for step in range(steps):
            start = (step * global_batch) % (len(x) - global_batch + 1)
            mine = order[start + data_rank * args.batch : start + (data_rank + 1) * args.batch]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        train_time = time.perf_counter() - started
        test_loss, accuracy = evaluate(model, x_test, y_test, rank, world)
        seams = compression.stats()
        survey.report_metrics(
            epoch=epoch + 1,
            train_time_s=train_time,
            accuracy=accuracy,
            loss=test_loss,
            perplexity=math.exp(test_loss),
            train_loss=sum(losses) / len(losses),
            samples=len(losses) * args.batch,
            shard_bytes_per_step=seams["reduce_scatter"]["bytes_sent"] / max(1, (epoch + 1) * steps),
        )
        if rank == 0:
            sent = {seam: f"{s['bytes_sent'] / ((epoch + 1) * steps):.0f} B/step" for seam, s in seams.items()}
            print(f"epoch {epoch + 1}: loss {test_loss:.3f}, next-token accuracy {accuracy:.3f}, sent {sent}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
