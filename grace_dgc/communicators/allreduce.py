import torch

from ..interfaces import Communicator
from ..registry import register_communicator


@register_communicator("allreduce")
class Allreduce(Communicator):
    """Sum every payload tensor over ranks. Valid only for summable compressors
    (e.g. none, fp16, randomk), whose payloads can be added elementwise.

    Tensors of one dtype are flattened into one buffer and summed by one collective
    (a fused group costs one allreduce per dtype, not one per tensor).
    """
    reduces = True
    needs_summable = True

    def exchange(self, payload, name):
        summed = [None] * len(payload)
        for dtype in dict.fromkeys(t.dtype for t in payload):
            members = [i for i, t in enumerate(payload) if t.dtype == dtype]
            fused = torch.cat([payload[i].reshape(-1) for i in members])   # a copy: inputs stay intact
            fused = self.engine.allreduce(fused)
            for i, part in zip(members, fused.split([payload[i].numel() for i in members])):
                summed[i] = part.view(payload[i].shape)
        return [summed]
