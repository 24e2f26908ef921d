from .. import wire
from ..interfaces import ExchangeCommunicator, Payload
from ..registry import register_communicator


@register_communicator("allgather")
class Allgather(ExchangeCommunicator):
    """Every rank receives every rank's payload, sizes may differ.

    1. allgather the headers (per-tensor byte lengths, int64): the size exchange;
    2. allgather the flat byte buffers, padded to the longest (skipped if all are empty).
    """

    def exchange(self, payload: Payload, name: str) -> list[Payload]:
        buffer, header = wire.encode(payload)
        headers = self.engine.allgather(header)
        sizes = [int(h.sum()) for h in headers]
        buffers = self.engine.allgather(buffer, sizes=sizes)
        return [wire.decode(b, h, payload) for b, h in zip(buffers, headers)]
