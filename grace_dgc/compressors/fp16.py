import torch

from ..interfaces import Compressor
from ..registry import register_compressor


@register_compressor("fp16", aliases=("half",))
class FP16Compressor(Compressor):
    """Cast to IEEE half precision for the wire (2 bytes/element), back on arrival.

    Values beyond ±65504 overflow to ±inf, as in Horovod's fp16 compression; the sum of
    an allreduce is also taken in half precision.
    """
    summable = True
    wire_dtype = torch.float16

    def compress(self, tensor, name):
        return [tensor.to(self.wire_dtype)], tensor.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)

    def sent_mask(self, payload, ctx):
        # every element is sent, also those that underflow to zero in the wire dtype
        return torch.ones_like(payload[0], dtype=torch.bool)
