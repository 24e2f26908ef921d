import torch

from ..interfaces import Compressor
from ..registry import register_compressor


@register_compressor("fp16", aliases=("half",))
class FP16Compressor(Compressor):
    """Cast to IEEE half precision for the wire (2 bytes/element), back on arrival.

        payload = fp16(g) / N          (divided before the sum, as torch's fp16_compress_hook,
        D(payload) = N · fp32(payload)  so an N-rank fp16 sum does not overflow)

    Values beyond ±65504 still overflow to ±inf, as in Horovod's fp16 compression; Grace's
    non-finite policy then skips the step on every rank (or raises), it does not pass it on. With a
    power-of-two N the averaged result equals torch's ``fp16_compress_hook`` bit for bit.
    """

    summable = True
    elementwise = True
    wire_dtype = torch.float16
    may_overflow = True  # beyond ±65504
    world_size = 1
    RANK_LOCAL = dict(Compressor.RANK_LOCAL, world_size="the engine's, handed over by bind")

    def bind(self, engine):
        """Called by Grace: the payload is pre-divided by the world size."""
        self.world_size = engine.size

    def compress(self, tensor, name):
        # a new wire tensor even when the input already has the wire dtype: never divide the input
        wire = torch.empty(tensor.shape, dtype=self.wire_dtype, device=tensor.device).copy_(tensor)
        return [wire if self.world_size == 1 else wire.div_(self.world_size)], tensor.dtype

    def decompress(self, payload, ctx):
        return self.decompress_into(payload, ctx, torch.empty(payload[0].shape, dtype=ctx, device=payload[0].device))

    def decompress_into(self, payload, ctx, out):
        out.copy_(payload[0].view(out.shape))
        return out if self.world_size == 1 else out.mul_(self.world_size)

    def sent_mask(self, payload, ctx):
        # every element is sent, also those that underflow to zero in the wire dtype
        return torch.ones_like(payload[0], dtype=torch.bool)

    def mask_sent_(self, tensor, payload, ctx):
        return tensor.zero_()  # every element was sent
