"""Collectives over a torchft ``Manager``'s process group: the replica groups of the current quorum.

torchft (pytorch/torchft) keeps a job training when a replica group is lost: a lighthouse keeps
the quorum, each group's ``Manager`` reconfigures the process group over the groups alive, and a
group that rejoins receives a healthy peer's state. This engine is grace's side of it: every
collective runs on the Manager's process group, the ranks are the quorum's, and a collective that
fails is reported to the Manager (this group's step will not commit, :meth:`Manager.should_commit`)
and raised as :class:`StepDiscarded`, which the way in turns into a discarded step. Nothing waits for
a lost group: its peers' collectives end at the process group's timeout or at once when its
connections close.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import GraceConfigError, StepDiscarded
from .base import Engine, pad_to


class TorchFTEngine(Engine):
    """grace's collectives on ``manager``'s process group. Its ``rank`` and ``size`` are this
    replica group's place in the current quorum and the quorum's participants
    (``Manager.num_participants()``), read again by :meth:`refresh` after each ``start_quorum``;
    averages divide by the participants. One rank per replica group, with a synchronous quorum
    (``use_async_quorum=False``): a group that heals has its peer's state before the step
    starts, so every member of the quorum takes part in every exchange."""

    name = "torchft"

    def __init__(self, manager: Any) -> None:
        super().__init__()
        for attribute in ("start_quorum", "should_commit", "num_participants", "report_error", "errored"):
            if not hasattr(manager, attribute):
                raise GraceConfigError(f"TorchFTEngine needs a torchft.Manager, got {type(manager).__name__}")
        if getattr(manager, "_use_async_quorum", False):
            raise GraceConfigError(
                "grace_dgc over torchft needs Manager(use_async_quorum=False): with an asynchronous quorum a "
                "healing group sends zeros while the others' exchanges already run, and grace's per-step state "
                "(error feedback, PowerSGD's Q) would follow a step it did not take"
            )
        if getattr(manager, "_group_world_size", 1) != 1:
            raise GraceConfigError(
                f"grace_dgc over torchft runs one rank per replica group; this Manager's group has "
                f"{manager._group_world_size} ranks"
            )
        self.manager = manager
        self.quorum: int | None = None  # the quorum id the ranks were read for (see refresh)

    @property
    def backend(self) -> str:
        return "gloo"  # torchft's ProcessGroupGloo; its NCCL group moves CUDA tensors the same way

    @property
    def pg(self) -> Any:
        return self.manager._pg

    def refresh(self) -> bool:
        """After ``start_quorum``: read this group's rank and the participants; True if the quorum
        is another one than at the last call (the ranks changed: grace agrees again)."""
        size, rank = self.manager.num_participants(), self.manager.participating_rank()
        if rank is None or size != self.pg.size():
            raise GraceConfigError(
                f"this replica group takes no part in the quorum's exchanges (rank {rank}, {size} participants of "
                f"{self.pg.size()}): grace_dgc over torchft needs every group of the quorum to take part "
                "(WorldSizeMode.DYNAMIC, no spares)"
            )
        quorum = self.manager._quorum_id
        changed, self.quorum, self.rank, self.size = quorum != self.quorum, quorum, rank, size
        return changed

    def _run(self, kind: str, launch: Callable[[], Any]) -> None:
        if self.manager.errored() is not None:  # a collective of this step failed already
            raise StepDiscarded(f"{kind} not started: an earlier collective of this step failed")
        try:
            launch().wait()
        except Exception as error:
            self.manager.report_error(error)
            raise StepDiscarded(
                f"{kind} failed on replica group {self.rank} of {self.size} ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:200] if str(error) else ''}): this group discards the step"
            ) from error

    def allreduce(self, tensor: Tensor) -> Tensor:
        from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

        self._count(tensor)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # the stub's enum type
        self._run("allreduce", lambda: self.pg.allreduce([tensor], options))
        return tensor

    def allgather(self, tensor: Tensor, sizes: Sequence[int] | None = None) -> list[Tensor]:
        from torch._C._distributed_c10d import AllgatherOptions

        longest = tensor.numel() if sizes is None else max(sizes)
        if longest == 0:
            return [tensor.new_empty(0) for _ in range(self.size)]
        padded = pad_to(tensor, longest)
        self._count(padded, received=longest * (self.size - 1))
        out = [torch.empty_like(padded) for _ in range(self.size)]
        self._run("allgather", lambda: self.pg.allgather([out], [padded], AllgatherOptions()))
        return out if sizes is None else [o[:n] for o, n in zip(out, sizes)]

    def broadcast(self, tensor: Tensor, root: int) -> Tensor:
        from torch._C._distributed_c10d import BroadcastOptions

        if root == self.rank:
            self._count(tensor, received=0)
        else:
            self._count(tensor.reshape(-1)[:0], received=tensor.numel())
        options = BroadcastOptions()
        options.rootRank = root
        self._run("broadcast", lambda: self.pg.broadcast([tensor], options))
        return tensor

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> Tensor:
        from torch._C._distributed_c10d import AllToAllOptions

        send, recv, out = self._all_to_all_buffers(tensor, send_sizes, recv_sizes)
        source = tensor.contiguous()
        self._run("all_to_all", lambda: self.pg.alltoall_base(out, source, recv, send, AllToAllOptions()))
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == root else None
        length = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        self.broadcast(length, root)
        buffer = data if data is not None else torch.empty(int(length[0]), dtype=torch.uint8)
        self.broadcast(buffer, root)
        return obj if self.rank == root else pickle.loads(buffer.numpy().tobytes())

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1))
