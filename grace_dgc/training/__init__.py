"""The ways in: what drives a :class:`~grace_dgc.grace.Grace` in a training loop.

- :mod:`.optimizer`: ``DistributedOptimizer``, a wrapper of any torch optimizer that
  exchanges each gradient bucket as backward produces it (Horovod's way);
- :mod:`.ddp`: ``ddp_comm_hook``, the same exchange inside torch's DDP;
- :mod:`.fsdp`: ``fsdp_compression``, FSDP2's reduce-scatter and HSDP's replicate seam;
- :mod:`.schedules`: *when* and *what* is exchanged: DiLoCo, local SGD, SparseLoCo,
  Streaming DiLoCo (outer loops) and 1-bit / 0/1 Adam;
- :mod:`.checkpoint`: rank-0 and per-rank checkpoints of any of them;
- :mod:`.integrations`: Lightning, Accelerate and the Hugging Face Trainer.
"""
