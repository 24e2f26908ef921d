from __future__ import annotations

import math
from typing import Any

from .. import wire
from ..interfaces import Cost, Payload
from ..registry import register_communicator
from .exchange import ExchangeCommunicator


@register_communicator("broadcast")
class Broadcast(ExchangeCommunicator):
    """Each rank broadcasts its payload in turn (rank 0 first).

    1. allgather the headers so every rank knows every payload's byte length;
    2. for each rank r: r broadcasts its flat buffer, the others receive it
       (a rank with an empty payload is skipped by everyone, so nobody waits).
    """

    @classmethod
    def cost(cls, nodes: int, nbytes: float, dense_bytes: float, **settings: Any) -> Cost:
        """The header allgather's N−1 steps, then N pipelined tree broadcasts of ⌈log2 N⌉ hops:
        N · n bytes."""
        steps = (nodes - 1) + nodes * math.ceil(math.log2(nodes))
        return Cost(steps, nodes * nbytes, sent=nbytes, received=(nodes - 1) * nbytes)

    def exchange(self, payload: Payload, name: str) -> list[Payload]:
        buffer, header = wire.encode(payload)
        headers = self.engine.allgather(header)
        gathered = []
        for root, head in enumerate(headers):
            size = int(head.sum())
            data = buffer if root == self.engine.rank else buffer.new_empty(size)
            if size:
                data = self.engine.broadcast(data, root)
            gathered.append(wire.decode(data, head, payload))
        return gathered
