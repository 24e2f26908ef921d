r"""A survey script trained with Hugging Face Accelerate: a small CNN on scikit-learn's digits, its
gradients compressed by grace_dgc, attached in one call after ``prepare``.

    grace-dgc survey --script examples/survey_accelerate.py --config examples/survey_script.toml \
        --out runs/accelerate [--script-args --epochs 6]
    torchrun --nproc-per-node 2 examples/survey_accelerate.py --epochs 3      # alone: top-k 1 % + residual

``survey_attach`` gives the prepared model the cell's method (alone: the one named here);
``survey_log`` reports each epoch to the survey (every rank) and to Accelerate's trackers.
"""

import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from survey_classifier import arguments, loaders, model

import grace_survey as survey
from grace_survey.script.accelerate import survey_attach, survey_log


def evaluate(accelerator, net, loader):
    """(loss, accuracy) over the test split, each process scoring its shard."""
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            sums += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(), (out.argmax(1) == y).sum(), len(y)])
    net.train()
    sums = accelerator.reduce(sums, reduction="sum")
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = arguments(__doc__)

    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // accelerator.num_processes))
    seed = survey.cell_seed()
    torch.manual_seed(seed)  # the same initial weights on every rank and for every method
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    shuffled, test = loaders(args.batch, seed)
    net, optimizer, shuffled, test = accelerator.prepare(net, optimizer, shuffled, test)
    survey_attach(accelerator, net, "topk", "residual", "allgather", optimizer=optimizer, compress_ratio=0.01)
    for epoch in range(1, args.epochs + 1):
        losses = []
        for inputs, labels in shuffled:
            loss = F.cross_entropy(net(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        test_loss, test_accuracy = evaluate(accelerator, net, test)
        survey_log(accelerator, epoch, accuracy=test_accuracy, loss=test_loss, train_loss=sum(losses) / len(losses))
        accelerator.print(f"epoch {epoch}: test accuracy {test_accuracy:.3f}, loss {test_loss:.3f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
