from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import GraceConfigError


class Engine:
    """Blocking collectives over a group of ``size`` ranks; this one is ``rank``.

    Two counters, both independent of the algorithm the runtime picks (ring, tree, …):

    * ``bytes_sent``: what this rank hands to collectives as its own contribution
      (allreduce: the buffer; allgather: its padded buffer; broadcast: the buffer when it
      is the root; all_to_all: the parts addressed to other ranks);
    * ``bytes_received``: what this rank gets back from the others (allreduce: the summed
      buffer; allgather: the other ranks' padded buffers, so it grows with N; broadcast:
      the buffer when not the root; all_to_all: the parts other ranks addressed to it).

    Engines made by :meth:`split` for subgroups add to the same counters.
    """

    name = "base"
    rank = 0
    size = 1
    collectives = True  # False: a view of the world that refuses collectives (hierarchical's NodesView)

    @property
    def backend(self) -> str:
        """The transport under the engine: ``gloo``/``nccl``/… for torch, else its name."""
        return self.name

    @property
    def control_device(self) -> torch.device:
        """Where the engine's own small tensors (flags, fingerprints, link probes) live: the
        rank's current GPU under NCCL (which takes CUDA tensors only), else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def local_rank(self) -> int:
        """This rank's index on its machine (which GPU it takes)."""
        return self.rank

    def __init__(self) -> None:
        self.traffic = Traffic()

    @property
    def bytes_sent(self) -> int:
        return self.traffic.sent

    @property
    def bytes_received(self) -> int:
        return self.traffic.received

    def fail(self, error: BaseException) -> None:
        """This rank met ``error`` between or inside collectives and cannot stay in step:
        tell the other ranks, so that the collective they wait in ends with an error naming
        this rank and its error (one process: nothing to tell)."""

    def close(self) -> None:
        """Release what the engine holds for itself (a process group of its own); nothing by default."""

    def allreduce(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over ranks; returns the summed tensor (possibly in place)."""
        raise NotImplementedError

    def allgather(self, tensor: Tensor, sizes: Sequence[int] | None = None) -> list[Tensor]:
        """Every rank's 1-D ``tensor``; ``sizes[r]`` is rank r's length when they differ."""
        raise NotImplementedError

    def broadcast(self, tensor: Tensor, root: int) -> Tensor:
        """``tensor`` of rank ``root``, written into ``tensor`` on the other ranks."""
        raise NotImplementedError

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> Tensor:
        """Personalised exchange of a 1-D ``tensor``: its first ``send_sizes[0]`` elements go to
        rank 0, the next ``send_sizes[1]`` to rank 1, …; returns the concatenation of what each
        rank addressed to this one, ``recv_sizes[s]`` elements from rank s, in rank order.
        The sizes must agree across ranks (exchange them first, e.g. by an all_to_all of
        counts with sizes of one)."""
        raise NotImplementedError

    def split(self, groups: Sequence[Sequence[int]]) -> Engine | None:
        """Engines over subgroups: every rank calls it with the same list of disjoint rank
        lists (ranks of this engine); returns the engine of the group this rank is in (its
        ``rank`` and ``size`` are within the group), or None. Collective: call it on every
        rank, in the same order as the other collectives."""
        raise GraceConfigError(f"engine {self.name!r} cannot form subgroups")

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        pass

    def _count(self, tensor: Tensor, received: int | None = None) -> None:
        """Count ``tensor`` as sent and ``received`` elements of its dtype as received
        (default: as many as sent, an allreduce)."""
        size = tensor.element_size()
        self.traffic.sent += tensor.numel() * size
        self.traffic.received += (tensor.numel() if received is None else received) * size

    def _all_to_all_buffers(
        self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]
    ) -> tuple[list[int], list[int], Tensor]:
        """An all_to_all's sizes (checked, as ints) and its output buffer; counts what crosses to
        other ranks (a rank's part for itself stays home)."""
        self._check_splits(tensor, send_sizes, recv_sizes)
        send, recv = [int(n) for n in send_sizes], [int(n) for n in recv_sizes]
        self._count(tensor[: tensor.numel() - send[self.rank]], received=sum(recv) - recv[self.rank])
        return send, recv, tensor.new_empty(sum(recv))

    def _check_splits(self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> None:
        if len(send_sizes) != self.size or len(recv_sizes) != self.size:
            raise GraceConfigError(
                f"all_to_all needs one send and one receive size per rank ({self.size}); got "
                f"{len(send_sizes)} and {len(recv_sizes)}"
            )
        if sum(send_sizes) != tensor.numel() or min(send_sizes, default=0) < 0 or min(recv_sizes, default=0) < 0:
            raise GraceConfigError(
                f"all_to_all send_sizes={list(send_sizes)} must be non-negative and add up to the "
                f"tensor's {tensor.numel()} elements"
            )


class Traffic:
    """Bytes counted by an engine (and the engines of its subgroups)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.seconds = 0.0  # spent waiting in collectives (torch engine): the rest is local compute


def pad_to(tensor: Tensor, length: int) -> Tensor:
    """``tensor`` (1-D) zero-padded to ``length`` elements."""
    if tensor.numel() == length:
        return tensor
    out = torch.zeros(length, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.numel()] = tensor
    return out
