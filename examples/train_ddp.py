r"""Train a small MLP with DistributedDataParallel, compressing through grace's DDP
communication hook, under torchrun.

    torchrun --nproc_per_node 2 examples/train_ddp.py \
        --compressor topk --memory residual --communicator allgather --param compress_ratio=0.01

With ``--checkpoint DIR`` each rank saves model, optimizer and hook state (its own
error-feedback residuals) to ``DIR/rank<r>.pt`` at the end, and a later run with the same
DIR resumes from there exactly.

Data are generated (a random teacher network labels Gaussian inputs), so the script runs
anywhere: gloo on CPU, NCCL when every rank has a GPU. Rank 0 prints the loss (averaged
over ranks) and, at the end, the bytes each rank put on the wire.
"""
import argparse
import ast
import os

import torch
import torch.distributed as dist

import grace_dgc


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressor", default="topk", help=f"one of {', '.join(grace_dgc.list_compressors())}")
    parser.add_argument("--memory", default="residual", help=f"one of {', '.join(grace_dgc.list_memories())}")
    parser.add_argument("--communicator", default="allgather",
                        help=f"one of {', '.join(grace_dgc.list_communicators())}")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a method parameter, e.g. compress_ratio=0.01 (repeatable)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    parser.add_argument("--checkpoint", metavar="DIR", help="resume from / save to DIR/rank<r>.pt")
    return parser.parse_args()


def method_params(pairs):
    """``["compress_ratio=0.01", "seed=3"]`` → ``{"compress_ratio": 0.01, "seed": 3}``."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--param {pair!r}: expected NAME=VALUE, e.g. compress_ratio=0.01")
        try:
            params[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[name] = value        # a plain string
    return params


def generated_data(steps, batch, world_size, seed, dim=16, classes=4):
    """The same (inputs, labels) on every rank; rank r trains on rows r, r+N, r+2N, ..."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(dim, classes, generator=gen)
    x = torch.randn(steps, batch * world_size, dim, generator=gen)
    return x, (x @ teacher).argmax(dim=-1)


def main():
    args = parse_args()
    params = method_params(args.param)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(model)      # broadcasts rank 0's parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    grace = grace_dgc.build(args.compressor, args.memory, args.communicator, **params)
    state, hook = grace_dgc.ddp_comm_hook(grace, model, optimizer)
    model.register_comm_hook(state, hook)

    start, path = 0, None
    if args.checkpoint:
        os.makedirs(args.checkpoint, exist_ok=True)
        path = os.path.join(args.checkpoint, f"rank{rank}.pt")
        if os.path.exists(path):
            checkpoint = torch.load(path, map_location=device, weights_only=False)
            model.module.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            state.load_state_dict(checkpoint["grace"])
            start = checkpoint["step"]
    if rank == 0:
        print(f"{grace} in a DDP hook on {world_size} ranks ({device.type})"
              + (f", resumed at step {start}" if start else ""), flush=True)

    inputs, labels = generated_data(start + args.steps, args.batch, world_size, args.seed)
    for step in range(start, start + args.steps):
        x, y = inputs[step, rank::world_size].to(device), labels[step, rank::world_size].to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % args.log_every == 0 or step == start + args.steps - 1):
            print(f"step {step:4d}  loss {mean_loss.item() / world_size:.4f}", flush=True)

    if path:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "grace": state.state_dict(), "step": start + args.steps}, path)
    stats = grace.stats()
    if rank == 0:
        print(f"bytes sent per step (rank 0): {stats['bytes_per_step']:.0f}  "
              f"dense fp32: {stats['dense_bytes'] / stats['steps']:.0f}  "
              f"ratio: {stats['compression_ratio']:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
