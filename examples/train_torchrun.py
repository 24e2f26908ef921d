r"""Train a small MLP with gradient compression under torchrun (grace_dgc.DistributedOptimizer).

    torchrun --nproc_per_node 2 examples/train_torchrun.py \
        --compressor topk --memory residual --communicator allgather --param compress_ratio=0.01

Data are generated (a random teacher network labels Gaussian inputs), so the script runs
anywhere: gloo on CPU, NCCL when every rank has a GPU. Rank 0 prints the loss (averaged
over ranks) and, at the end, the bytes each rank put on the wire.
"""

import torch
import torch.distributed as dist
from common import generated_data, parse_args, report_done, report_wire, say, start_torchrun, train

import grace_dgc


def main():
    args = parse_args(__doc__)
    rank, world_size, device, model = start_torchrun(args)
    grace = grace_dgc.build(args.compressor, args.memory, args.communicator, **args.params)
    optimizer = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), grace, model.named_parameters()
    )
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)  # same start on every rank
    if rank == 0:
        say(f"{grace} on {world_size} ranks ({device.type})")

    data = generated_data(args.steps, args.batch, rank, world_size, args.seed, device)
    train(model, optimizer, data, range(args.steps), rank, world_size, args.log_every)

    report_wire(grace, rank)
    dist.destroy_process_group()
    report_done(rank)


if __name__ == "__main__":
    main()
