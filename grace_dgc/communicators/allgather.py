from __future__ import annotations

from typing import Any

from .. import wire
from ..interfaces import Cost, Payload
from ..registry import register_communicator
from .exchange import ExchangeCommunicator


@register_communicator("allgather")
class Allgather(ExchangeCommunicator):
    """Every rank receives every rank's payload, sizes may differ.

    1. allgather the headers (per-tensor byte lengths, int64): the size exchange;
    2. allgather the flat byte buffers, padded to the longest (skipped if all are empty).
    """

    @classmethod
    def cost(cls, nodes: int, nbytes: float, dense_bytes: float, **settings: Any) -> Cost:
        """The size headers, then the data: 2(N−1) steps, (N−1) · n bytes."""
        return Cost(2 * (nodes - 1), (nodes - 1) * nbytes, sent=nbytes, received=(nodes - 1) * nbytes)

    def exchange(self, payload: Payload, name: str) -> list[Payload]:
        buffer, header = wire.encode(payload)
        headers = self.engine.allgather(header)
        sizes = [int(h.sum()) for h in headers]
        buffers = self.engine.allgather(buffer, sizes=sizes)
        return [wire.decode(b, h, payload) for b, h in zip(buffers, headers)]
