from __future__ import annotations

from typing import Any

from ..errors import GraceConfigError
from .base import Engine


class NodesView(Engine):
    """The world as the compressor and memory see it under ``hierarchical``: one rank per
    node (``rank`` = the node's index), no collectives of its own."""

    collectives = False

    def __init__(self, rank: int, size: int, name: str) -> None:
        super().__init__()
        self.rank, self.size, self.name = rank, size, name

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise GraceConfigError("only a node's leader exchanges between nodes")

    allreduce = allgather = broadcast = all_to_all = broadcast_object = _refuse
