r"""Train a small MLP with gradient compression under horovodrun (grace_dgc.DistributedOptimizer
over Horovod's own collectives: after ``hvd.init()``, ``engine="auto"`` picks Horovod).

    horovodrun -np 2 --gloo -H localhost:2 python examples/train_horovodrun.py \
        --compressor topk --memory residual --communicator allgather --param compress_ratio=0.01

Needs Horovod with PyTorch support (``scripts/install-horovod.sh``). Data are generated
(a random teacher network labels Gaussian inputs). Rank 0 prints the loss (averaged over
ranks) and, at the end, the bytes each rank put on the wire.
"""
import argparse
import ast

import horovod.torch as hvd
import torch

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
    hvd.init()
    rank, world_size = hvd.rank(), hvd.size()
    cuda = torch.cuda.is_available() and hvd.cuda_built()
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    grace = grace_dgc.build(args.compressor, args.memory, args.communicator, **params)
    optimizer = grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                               grace, model.named_parameters())
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)     # same start on every rank
    if rank == 0:
        print(f"{grace} on {world_size} ranks ({device.type})", flush=True)

    inputs, labels = generated_data(args.steps, args.batch, world_size, args.seed)
    for step in range(args.steps):
        x, y = inputs[step, rank::world_size].to(device), labels[step, rank::world_size].to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        mean_loss = hvd.allreduce(loss.detach(), op=hvd.Average, name="loss")
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean_loss.item():.4f}", flush=True)

    stats = grace.stats()
    if rank == 0:
        print(f"bytes sent per step (rank 0): {stats['bytes_per_step']:.0f}  "
              f"dense fp32: {stats['dense_bytes'] / stats['steps']:.0f}  "
              f"ratio: {stats['compression_ratio']:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
