from ..interfaces import Memory
from ..registry import register_memory


@register_memory("none")
class NoneMemory(Memory):
    """No memory: what the compressor drops is lost."""

    identity = True
