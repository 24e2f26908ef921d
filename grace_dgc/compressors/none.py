import torch

from ..interfaces import Compressor
from ..registry import register_compressor


@register_compressor("none", aliases=("dense", "identity"))
class NoneCompressor(Compressor):
    """No compression: the payload is the tensor itself (the dense baseline)."""

    summable = True
    elementwise = True

    def compress(self, tensor, name):
        return [tensor], None

    def decompress(self, payload, ctx):
        return payload[0]

    def decompress_into(self, payload, ctx, out):
        if payload[0].data_ptr() != out.data_ptr():  # reduced in place: already there
            out.copy_(payload[0].view(out.shape))
        return out

    def subtract_sent_(self, tensor, payload, ctx):
        return tensor.sub_(payload[0].view(tensor.shape))

    def sent_mask(self, payload, ctx):
        return torch.ones_like(payload[0], dtype=torch.bool)  # every element is sent

    def mask_sent_(self, tensor, payload, ctx):
        return tensor.zero_()  # every element was sent
