from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .base import Engine


class LocalEngine(Engine):
    """World size 1, no process group: collectives are identities (bytes still counted,
    so a one-worker run reports what it would put on the wire)."""

    name = "local"

    def allreduce(self, tensor: Tensor) -> Tensor:
        self._count(tensor, received=0)
        return tensor

    def allgather(self, tensor: Tensor, sizes: Sequence[int] | None = None) -> list[Tensor]:
        self._count(tensor, received=0)
        return [tensor]

    def broadcast(self, tensor: Tensor, root: int) -> Tensor:
        self._count(tensor, received=0)
        return tensor

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> Tensor:
        self._check_splits(tensor, send_sizes, recv_sizes)
        return tensor  # to itself: nothing crosses a wire

    def split(self, groups: Sequence[Sequence[int]]) -> Engine | None:
        return self if any(0 in ranks for ranks in groups) else None

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return copy.deepcopy(obj)


class PlanEngine(LocalEngine):
    """``size`` ranks on paper, seen from rank 0: for checking, before any process starts, that
    a configuration builds on the world size it will run with (a config on 4 workers with
    ``hierarchical(group_size=2)``). Splits are computed; nothing is exchanged."""

    name = "plan"

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def split(self, groups: Sequence[Sequence[int]]) -> Engine | None:
        for ranks in groups:
            if 0 in ranks:
                return PlanEngine(len(ranks))
        return None
