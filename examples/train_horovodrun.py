r"""Train a small MLP with gradient compression under horovodrun (grace_dgc.DistributedOptimizer
over Horovod's own collectives: after ``hvd.init()``, ``engine="auto"`` picks Horovod).

    horovodrun -np 2 --gloo -H localhost:2 python examples/train_horovodrun.py \
        --compressor topk --memory residual --communicator allgather --param compress_ratio=0.01

Needs Horovod with PyTorch support (``scripts/install-horovod.sh``). Data are generated
(a random teacher network labels Gaussian inputs). Rank 0 prints the loss (averaged over
ranks) and, at the end, the bytes each rank put on the wire.
"""

import horovod.torch as hvd
import torch
from common import generated_data, make_model, parse_args, report_done, report_loss, report_wire, say, select_device

import grace_dgc


def main():
    args = parse_args(__doc__)
    hvd.init()
    rank, world_size = hvd.rank(), hvd.size()
    device = select_device(torch.cuda.is_available() and hvd.cuda_built(), hvd.local_rank())

    model = make_model(device, args.seed)
    grace = grace_dgc.build(args.compressor, args.memory, args.communicator, **args.params)
    optimizer = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), grace, model.named_parameters()
    )
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)  # same start on every rank
    if rank == 0:
        say(f"{grace} on {world_size} ranks ({device.type})")

    inputs, labels = generated_data(args.steps, args.batch, rank, world_size, args.seed, device)
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs[step]), labels[step])
        loss.backward()
        optimizer.step()
        mean_loss = hvd.allreduce(loss.detach(), op=hvd.Average, name="loss")
        report_loss(rank, step, args.steps - 1, args.log_every, mean_loss.item())

    report_wire(grace, rank)
    hvd.shutdown()
    report_done(rank)


if __name__ == "__main__":
    main()
