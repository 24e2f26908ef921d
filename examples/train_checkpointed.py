r"""Train with gradient compression and checkpoint the way most training scripts do: rank 0
writes one file (as nanoGPT does), or torch.distributed.checkpoint writes a directory.

    torchrun --nproc_per_node 2 examples/train_checkpointed.py --steps 10 --checkpoint ckpt.pt
    torchrun --nproc_per_node 2 examples/train_checkpointed.py --steps 10 --checkpoint ckpt.pt   # resumes
    torchrun --nproc_per_node 2 examples/train_checkpointed.py --steps 10 --dcp ckpt_dir        # the same with DCP

grace's state is per rank (each rank's residuals, momenta, owner errors), so a rank-0 file
needs every rank's part in it:

* ``--checkpoint FILE``: every rank calls ``grace_dgc.gather_state(optimizer)`` (a collective;
  rank 0 gets every rank's state, the others None), and rank 0 saves it beside the model and
  the optimizer. On resume every rank reads FILE if it can (a shared file system) and calls
  ``grace_dgc.load_gathered_state(optimizer, its_part_or_None)``: a rank that passes None
  receives its part from rank 0. Add ``--rank0-reads`` to have only rank 0 read the file.
* ``--dcp DIR``: ``torch.distributed.checkpoint`` with the model and the wrapped optimizer as
  usual (the same on every rank) and ``grace_dgc.PerRankState(optimizer)``, which keeps each
  rank's grace state under a key of its own (DCP writes equal keys once).

A resumed run continues bit for bit: its losses equal those of the uninterrupted run.
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import generated_data, parse_args, report_done, report_wire, say, start_torchrun, train
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import grace_dgc


def save(args, rank, model, optimizer, step):
    if args.dcp:
        model_state, optim_state = get_state_dict(model, optimizer.optimizer)
        state = {"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(optimizer)}
        dcp.save(dict(state, step=step), checkpoint_id=args.dcp)
        return
    gathered = grace_dgc.gather_state(optimizer)  # every rank: a collective
    if rank == 0:
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.optimizer.state_dict(), "step": step}
        torch.save(dict(checkpoint, grace=gathered), args.checkpoint)


def resume(args, rank, model, optimizer, device):
    """The step to start from (0 without a checkpoint); loads the checkpoint on every rank."""
    if args.dcp:
        if not os.path.exists(os.path.join(args.dcp, ".metadata")):
            return 0
        model_state, optim_state = get_state_dict(model, optimizer.optimizer)
        state = {"model": model_state, "optim": optim_state, "grace": grace_dgc.PerRankState(optimizer), "step": 0}
        dcp.load(state, checkpoint_id=args.dcp)
        set_state_dict(model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return state["step"]
    found = torch.tensor([os.path.exists(args.checkpoint) if rank == 0 else 0])
    dist.broadcast(found, 0)  # rank 0 decides: the others may not see its file system
    if not found.item():
        return 0
    readable = rank == 0 or not args.rank0_reads
    checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=True) if readable else None
    step = torch.tensor([checkpoint["step"] if checkpoint else 0])
    dist.broadcast(step, 0)
    if checkpoint is None:  # the model and optimizer state are rank 0's: sent below
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.optimizer.state_dict(), "grace": None}
    model.load_state_dict(checkpoint["model"])
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)
    if readable:
        optimizer.optimizer.load_state_dict(checkpoint["optimizer"])
    grace_dgc.broadcast_optimizer_state(optimizer.optimizer, root_rank=0)
    grace_dgc.load_gathered_state(optimizer, checkpoint["grace"])  # a None part comes from rank 0
    return int(step.item())


def main():
    args = parse_args(
        __doc__,
        ("--checkpoint", {"metavar": "FILE", "help": "rank 0 saves to / every rank resumes from FILE"}),
        ("--rank0-reads", {"action": "store_true", "help": "only rank 0 reads FILE; it sends each rank its part"}),
        ("--dcp", {"metavar": "DIR", "help": "save to / resume from DIR with torch.distributed.checkpoint"}),
    )
    if bool(args.checkpoint) == bool(args.dcp):
        raise SystemExit("give one of --checkpoint FILE and --dcp DIR")
    rank, world_size, device, model = start_torchrun(args)
    grace = grace_dgc.build(args.compressor, args.memory, args.communicator, **args.params)
    optimizer = grace_dgc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), grace, model.named_parameters()
    )
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)  # same start on every rank
    start = resume(args, rank, model, optimizer, device)
    if rank == 0:
        resumed = f", resumed at step {start}" if start else ""
        say(f"{grace} on {world_size} ranks ({device.type}){resumed}")

    end = start + args.steps
    data = generated_data(end, args.batch, rank, world_size, args.seed, device)
    train(model, optimizer, data, range(start, end), rank, world_size, args.log_every)

    save(args, rank, model, optimizer, end)
    report_wire(grace, rank)
    dist.destroy_process_group()
    report_done(rank)


if __name__ == "__main__":
    main()
