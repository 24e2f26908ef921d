from torch import Tensor

from ..interfaces import Compressor, Payload
from ..registry import register_compressor


@register_compressor("none", aliases=("dense", "identity"))
class NoneCompressor(Compressor):
    """No compression: the payload is the tensor itself (the dense baseline)."""

    summable = True
    elementwise = True
    chunkable = True
    sends_all = True

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, None]:
        return [tensor], None

    def decompress(self, payload: Payload, ctx: None) -> Tensor:
        return payload[0]

    def decompress_into(self, payload: Payload, ctx: None, out: Tensor) -> Tensor:
        if payload[0].data_ptr() != out.data_ptr():  # reduced in place: already there
            out.copy_(payload[0].view(out.shape))
        return out

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: None) -> Tensor:
        return tensor.sub_(payload[0].view(tensor.shape))
