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

import os

import torch
import torch.distributed as dist
from common import generated_data, make_model, parse_args, report_done, report_wire, say, select_device, train

import grace_dgc


def main():
    args = parse_args(__doc__, ("--checkpoint", {"metavar": "DIR", "help": "resume from / save to DIR/rank<r>.pt"}))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = select_device(cuda, int(os.environ.get("LOCAL_RANK", 0)))

    model = make_model(device, args.seed)
    model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    grace = grace_dgc.build(args.compressor, args.memory, args.communicator, **args.params)
    state, hook = grace_dgc.ddp_comm_hook(grace, model, optimizer)
    model.register_comm_hook(state, hook)

    start, path = 0, None
    if args.checkpoint:
        os.makedirs(args.checkpoint, exist_ok=True)
        path = os.path.join(args.checkpoint, f"rank{rank}.pt")
        if os.path.exists(path):
            checkpoint = torch.load(path, map_location=device, weights_only=True)
            model.module.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            state.load_state_dict(checkpoint["grace"])
            start = checkpoint["step"]
    if rank == 0:
        resumed = f", resumed at step {start}" if start else ""
        say(f"{grace} in a DDP hook on {world_size} ranks ({device.type}){resumed}")

    end = start + args.steps
    data = generated_data(end, args.batch, rank, world_size, args.seed, device)
    train(model, optimizer, data, range(start, end), rank, world_size, args.log_every)

    if path:
        torch.save(
            {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "grace": state.state_dict(),
                "step": end,
            },
            path,
        )
    report_wire(grace, rank)
    dist.destroy_process_group()
    report_done(rank)


if __name__ == "__main__":
    main()
