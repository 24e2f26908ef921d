"""What the example scripts share: options, device, model, generated data, the training loop and the printed report.

Each script imports it with ``from common import ...``: ``python``, ``torchrun`` and
``horovodrun ... python`` put the script's own folder first on ``sys.path``.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

import grace_dgc
from grace_dgc.errors import parse_value


def parse_args(description, *options):
    """The command line; ``args.params`` holds the ``--param`` pairs as a dict (see ``method_params``).
    ``options``: a script's own, as ``(flag, add_argument keywords)`` pairs."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressor", default="topk", help=f"one of {', '.join(grace_dgc.list_compressors())}")
    parser.add_argument("--memory", default="residual", help=f"one of {', '.join(grace_dgc.list_memories())}")
    parser.add_argument(
        "--communicator", default="allgather", help=f"one of {', '.join(grace_dgc.list_communicators())}"
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a method parameter, e.g. compress_ratio=0.01 (repeatable)",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    for flag, keywords in options:
        parser.add_argument(flag, **keywords)
    args = parser.parse_args()
    args.params = method_params(args.param)
    return args


def method_params(pairs):
    """``["compress_ratio=0.01", "seed=3"]`` → ``{"compress_ratio": 0.01, "seed": 3}``."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--param {pair!r}: expected NAME=VALUE, e.g. compress_ratio=0.01")
        params[name] = parse_value(value)  # true/false become booleans
    return params


def select_device(cuda, local_rank):
    """GPU ``local_rank``, made the current one, when ``cuda``; else the CPU."""
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def make_model(device, seed):
    """The small MLP (16 inputs, 4 classes), initialised from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)


def generated_data(steps, batch, rank, world_size, seed, device, dim=16, classes=4):
    """This rank's (inputs, labels), one batch per step: every rank generates the same data
    (a random teacher network labels Gaussian inputs) and keeps rows r, r+N, r+2N, ..."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(dim, classes, generator=gen)
    x = torch.randn(steps, batch * world_size, dim, generator=gen)
    y = (x @ teacher).argmax(dim=-1)
    return x[:, rank::world_size].to(device), y[:, rank::world_size].to(device)


def start_torchrun(args):
    """Under torchrun: the process group (NCCL when there is a GPU, else gloo), this rank's
    device and the model. Returns (rank, world_size, device, model)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = select_device(cuda, int(os.environ.get("LOCAL_RANK", 0)))
    return rank, world_size, device, make_model(device, args.seed)


def train(model, optimizer, data, steps, rank, world_size, log_every):
    """The steps in ``steps`` on this rank's batches (``data``: generated_data's pair); rank 0
    prints the loss averaged over ranks (torch.distributed)."""
    inputs, labels = data
    for step in steps:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs[step]), labels[step])
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        report_loss(rank, step, steps[-1], log_every, mean_loss.item() / world_size)


def say(line):
    """Print one whole line in one write: the ranks share the launcher's stdout, and with
    PYTHONUNBUFFERED a ``print`` writes its text and its newline separately, so another
    rank's line could land in between."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def report_loss(rank, step, last_step, every, loss):
    """Rank 0 prints ``loss`` (a float, the mean over ranks) every ``every`` steps and at ``last_step``."""
    if rank == 0 and (step % every == 0 or step == last_step):
        say(f"step {step:4d}  loss {loss:.4f}")


def report_wire(grace, rank):
    """Rank 0 prints the bytes it put on the wire per step, against a dense fp32 exchange."""
    stats = grace.stats()
    if rank == 0:
        say(
            f"bytes sent per step (rank 0): {stats['bytes_per_step']:.0f}  "
            f"dense fp32: {stats['dense_bytes'] / stats['steps']:.0f}  "
            f"ratio: {stats['compression_ratio']:.4f}"
        )


def report_done(rank):
    """Every rank says it finished its work (after destroy_process_group): a crash in the
    interpreter's teardown after this line lost nothing."""
    say(f"rank {rank} done")
