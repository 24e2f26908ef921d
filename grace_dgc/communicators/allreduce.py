from ..interfaces import Communicator
from ..registry import register_communicator


@register_communicator("allreduce")
class Allreduce(Communicator):
    """Sum every payload tensor over ranks. Valid only for summable compressors
    (e.g. none, fp16, randomk), whose payloads can be added elementwise."""
    reduces = True
    needs_summable = True

    def exchange(self, payload, name):
        return [[self.engine.allreduce(t.clone()) for t in payload]]
