import torch
import torch.distributed as dist

from ..errors import GraceConfigError
from .base import Engine, pad_to


class TorchEngine(Engine):
    """torch.distributed (gloo on CPU, NCCL on GPU) on the default or a given process group."""
    name = "torch"

    def __init__(self, process_group=None):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise GraceConfigError(
                "engine='torch' needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the env), "
                "or use engine='local' for a single process")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        self.backend = dist.get_backend(process_group)

    def _global(self, rank):
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def allreduce(self, tensor):
        self._count(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def allgather(self, tensor, sizes=None):
        # torch.distributed gathers equal sizes only: pad to the largest, then trim.
        longest = tensor.numel() if sizes is None else max(sizes)
        if longest == 0:        # every rank is empty: nothing to move, and no rank waits
            return [tensor.new_empty(0) for _ in range(self.size)]
        padded = pad_to(tensor, longest)
        self._count(padded)
        out = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(out, padded, group=self.group)
        return out if sizes is None else [o[:n] for o, n in zip(out, sizes)]

    def broadcast(self, tensor, root):
        if root == self.rank:
            self._count(tensor)
        dist.broadcast(tensor, src=self._global(root), group=self.group)
        return tensor

    def broadcast_object(self, obj, root=0):
        box = [obj if self.rank == root else None]
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        dist.broadcast_object_list(box, src=self._global(root), group=self.group, device=device)
        return box[0]

    def barrier(self):
        dist.barrier(group=self.group)
