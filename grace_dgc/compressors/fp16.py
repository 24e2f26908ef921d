from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..interfaces import Compressor, Payload
from ..registry import register_compressor

if TYPE_CHECKING:
    from ..engines.base import Engine


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
    chunkable = True
    sends_all = True  # also the elements that underflow to zero in the wire dtype
    wire_dtype = torch.float16
    may_overflow = True  # beyond ±65504
    world_size = 1
    RANK_LOCAL = dict(Compressor.RANK_LOCAL, world_size="the engine's, handed over by bind")

    def bind(self, engine: Engine) -> None:
        """Called by Grace: the payload is pre-divided by the world size."""
        self.world_size = engine.size

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, torch.dtype]:
        # a new wire tensor even when the input already has the wire dtype: never divide the input
        wire = torch.empty(tensor.shape, dtype=self.wire_dtype, device=tensor.device).copy_(tensor)
        return [wire if self.world_size == 1 else wire.div_(self.world_size)], tensor.dtype

    def decompress(self, payload: Payload, ctx: torch.dtype) -> Tensor:
        return self.decompress_into(payload, ctx, torch.empty(payload[0].shape, dtype=ctx, device=payload[0].device))

    def decompress_into(self, payload: Payload, ctx: torch.dtype, out: Tensor) -> Tensor:
        out.copy_(payload[0].view(out.shape))
        return out if self.world_size == 1 else out.mul_(self.world_size)
