from .. import wire
from ..interfaces import ExchangeCommunicator, Payload
from ..registry import register_communicator


@register_communicator("broadcast")
class Broadcast(ExchangeCommunicator):
    """Each rank broadcasts its payload in turn (rank 0 first).

    1. allgather the headers so every rank knows every payload's byte length;
    2. for each rank r: r broadcasts its flat buffer, the others receive it
       (a rank with an empty payload is skipped by everyone, so nobody waits).
    """

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
