r"""Your own training script under the survey (script mode): a small CNN on scikit-learn's digits.

    grace-dgc survey --script examples/survey_classifier.py --config examples/survey_script.toml \
        --out runs/my-script [--script-args --epochs 6]

The survey runs this script once per cell (method × workers × seed) on that cell's ranks.
Three calls make it a survey script; everything else is an ordinary torchrun script:

    survey.cell_seed()         the cell's seed: the same initial weights and data order for every method
    survey.cell_grace(...)     the cell's method as a Grace (run alone: the method given here)
    survey.report_metrics(...) this epoch's metrics, once per epoch on every rank

Run alone it trains with the fallback method:

    torchrun --nproc-per-node 2 examples/survey_classifier.py --epochs 3
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits

import grace_dgc
import grace_survey as survey


def digits(seed):
    """(train x, train y, test x, test y): 8×8 images in [0, 1], a seeded 80/20 split."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    y = torch.tensor(labels)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def arguments(doc):
    """The options of the digits examples (this one, the Lightning and the Accelerate one)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()


def loaders(batch, seed):
    """(train, test) DataLoaders over :func:`digits`, the training one shuffled from ``seed``: what the
    Lightning and Accelerate examples feed their trainers (which shard them over the ranks)."""
    x, y, x_test, y_test = digits(seed=0)  # the data is the same for every seed
    shuffled = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    return shuffled, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_test, y_test), batch_size=256)


def model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 10),
    )


def evaluate(net, x, y, rank, world_size):
    """(loss, accuracy) over the test split, each rank scoring its shard."""
    net.eval()
    with torch.no_grad():
        out = net(x[rank::world_size])
        sums = torch.tensor(
            [
                F.cross_entropy(out, y[rank::world_size], reduction="sum").item(),
                (out.argmax(1) == y[rank::world_size]).sum().item(),
                len(out),
            ],
            dtype=torch.float64,
        )
    dist.all_reduce(sums)
    net.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = arguments(__doc__)

    dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    seed = survey.cell_seed()
    x, y, x_test, y_test = digits(seed=0)  # the data is the same for every seed
    torch.manual_seed(seed)  # the same initial weights on every rank and for every method
    net = model()
    grace = survey.cell_grace("topk", "residual", "allgather", compress_ratio=0.01)
    optimizer = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9), grace, net.named_parameters()
    )
    global_batch = args.batch * world_size
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        losses = []
        started = time.perf_counter()
        for start in range(0, len(x) - global_batch + 1, global_batch):
            mine = order[start + rank * args.batch : start + (rank + 1) * args.batch]  # this rank's share
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x[mine]), y[mine])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        train_time = time.perf_counter() - started
        test_loss, test_accuracy = evaluate(net, x_test, y_test, rank, world_size)
        survey.report_metrics(
            epoch=epoch + 1,
            train_time_s=train_time,  # evaluation left out, as the built-in workloads time it
            accuracy=test_accuracy,
            loss=test_loss,
            train_loss=sum(losses) / len(losses),
            samples=len(losses) * args.batch,
        )
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {test_accuracy:.3f}, loss {test_loss:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
