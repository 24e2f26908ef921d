from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class Engine:
    """Blocking collectives over a group of ``size`` ranks; this one is ``rank``.

    ``bytes_sent`` counts what this rank hands to collectives as its own contribution
    (allreduce: the buffer; allgather: its padded buffer; broadcast: the buffer when it
    is the root), so the figure is the same whatever algorithm the runtime uses.
    """

    name = "base"
    rank = 0
    size = 1

    @property
    def backend(self) -> str:
        """The transport under the engine: ``gloo``/``nccl``/… for torch, else its name."""
        return self.name

    @property
    def local_rank(self) -> int:
        """This rank's index on its machine (which GPU it takes)."""
        return self.rank

    def __init__(self) -> None:
        self.bytes_sent = 0

    def allreduce(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over ranks; returns the summed tensor (possibly in place)."""
        raise NotImplementedError

    def allgather(self, tensor: Tensor, sizes: Sequence[int] | None = None) -> list[Tensor]:
        """Every rank's 1-D ``tensor``; ``sizes[r]`` is rank r's length when they differ."""
        raise NotImplementedError

    def broadcast(self, tensor: Tensor, root: int) -> Tensor:
        """``tensor`` of rank ``root``, written into ``tensor`` on the other ranks."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        pass

    def _count(self, tensor: Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()


def pad_to(tensor: Tensor, length: int) -> Tensor:
    """``tensor`` (1-D) zero-padded to ``length`` elements."""
    if tensor.numel() == length:
        return tensor
    out = torch.zeros(length, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.numel()] = tensor
    return out
