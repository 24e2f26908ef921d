"""Under ``horovodrun -np 2``: rank 0 meets an error on its own in its second exchange;
every rank prints what it got (``RESULT rank kind seconds``) and exits."""

import time

import horovod.torch as hvd
import torch

import grace_dgc

hvd.init()
rank = hvd.rank()  # hvd.rank() raises once Horovod is shut down
grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.5)
grace.step(torch.ones(64), "w")
if rank == 0:

    def compress(tensor, name):
        raise RuntimeError("boom in compress")

    grace.wire.compress = compress
start = time.monotonic()
try:
    grace.step(torch.ones(64), "w")
    kind = "none"
except Exception as error:
    kind = type(error).__name__
print(f"RESULT {rank} {kind} {time.monotonic() - start:.1f}", flush=True)
