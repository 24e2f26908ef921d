r"""Your own language-model script under the survey (script mode): a small GPT trained with AdamW,
warmed up and cosine-decayed as nanoGPT trains its character-level GPT.

    grace-dgc survey --script examples/survey_transformer.py --config examples/survey_script.toml \
        --out runs/my-gpt --script-args --epochs 2 --train-chars 100000

The script is the user's: its data, its model, its optimizer (AdamW here: script mode runs
any optimizer DistributedOptimizer wraps), its metrics. The survey gives it the cell's seed
and method and records what it reports; next-token accuracy is reported as ``accuracy``
(the target of time-to-target) and perplexity as a named metric of its own. The text is
Python's own help text and the model a GPT-style decoder (``grace_survey.workloads.text``: a
workload of the survey too, ``pydoc-gpt``); bring yours in their place.

Run alone:  torchrun --nproc-per-node 2 examples/survey_transformer.py --epochs 1 --train-chars 50000
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import grace_dgc
import grace_survey as survey
from grace_survey.workloads.text import CharTransformer, corpus_text, encode, split_bounds, vocabulary, windows


def evaluate(model, inputs, targets, rank, world_size):
    """(mean cross-entropy per token, next-token accuracy) over every rank's shard of windows."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for start in range(rank * 64, len(inputs), world_size * 64):
            logits = model(inputs[start : start + 64])
            y = targets[start : start + 64]
            sums += torch.tensor(
                [
                    F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item(),
                    (logits.argmax(-1) == y).sum().item(),
                    y.numel(),
                ],
                dtype=torch.float64,
            )
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def get_lr(step, total, peak, warmup):
    """nanoGPT's schedule: linear warm-up over ``warmup`` steps, then cosine decay to peak / 10."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak / 10 + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - peak / 10)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="windows per rank and step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--train-chars", type=int, default=0, help="use the first N characters of train (0: all)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    text = corpus_text()
    vocab = vocabulary(text)
    train_end, valid_end = split_bounds(len(text))
    train_text = text[:train_end][: args.train_chars or None]
    x, y = windows(encode(train_text, vocab), args.context)
    x_test, y_test = windows(encode(text[valid_end:], vocab), args.context)

    seed = survey.cell_seed()
    torch.manual_seed(seed)  # the same initial weights for every method
    model = CharTransformer(len(vocab), args.context, d_model=128, n_layer=4, n_head=4)
    grace = survey.cell_grace("none")  # run alone: dense allreduce
    optimizer = grace_dgc.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1),
        grace,
        model.named_parameters(),
    )
    global_batch = args.batch * world_size
    total, step = args.epochs * (len(x) // global_batch), 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        losses = []
        started = time.perf_counter()
        for start in range(0, len(x) - global_batch + 1, global_batch):
            mine = order[start + rank * args.batch : start + (rank + 1) * args.batch]
            for group in optimizer.param_groups:
                group["lr"] = get_lr(step, total, args.lr, args.warmup_steps)
            step += 1
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
            loss.backward()
            optimizer.synchronize()  # clip the averaged gradient, then step once
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
            losses.append(loss.item())
        train_time = time.perf_counter() - started
        test_loss, accuracy = evaluate(model, x_test, y_test, rank, world_size)
        survey.report_metrics(
            epoch=epoch + 1,
            train_time_s=train_time,  # evaluation left out, as the built-in workloads time it
            accuracy=accuracy,
            loss=test_loss,
            perplexity=math.exp(test_loss),
            train_loss=sum(losses) / len(losses),
            samples=len(losses) * args.batch,
        )
        if rank == 0:
            print(f"epoch {epoch + 1}: next-token accuracy {accuracy:.3f}, perplexity {math.exp(test_loss):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
