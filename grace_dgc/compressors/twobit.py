import torch

from .. import wire
from ..errors import check_range
from ..interfaces import Compressor
from ..registry import register_compressor

# 2-bit codes, as in MXNet: 00 → 0, 11 → +τ, 10 → −τ (01 is never sent, decodes to 0)
NEGATIVE, POSITIVE = 2, 3


@register_compressor("twobit", aliases=("2bit",))
class TwoBitCompressor(Compressor):
    """MXNet 2-bit quantisation: ±τ where |g| ≥ τ, else 0; 2 bits/element; use with memory residual.

    MXNet FAQ "Gradient Compression" (after Strom 2015), threshold τ = ``threshold``:

        q_i = +τ if g_i ≥ τ,   −τ if g_i ≤ −τ,   0 otherwise,

    and the quantisation error g − q is kept in the error-feedback memory, so what is not
    sent now is sent once it has accumulated past τ. MXNet always keeps that residual:
    build this compressor with ``memory="residual"`` (without it every |g_i| < τ is lost
    for good; that combination is allowed, for ablations, but is not MXNet's method).

    Wire: 2 bits per element, element i at bits [2i, 2i+2) of the little-endian stream
    (wire.pack_bits), i.e. 4 per byte and 16 per 32-bit little-endian word, element 16w+j
    at bits 2j..2j+1 of word w; ⌈n/4⌉ bytes (the last word is not padded). τ is a
    parameter every rank shares, so it does not travel. Codes cannot be summed, so it
    needs allgather or broadcast.
    """

    def __init__(self, threshold=0.5):
        self.threshold = check_range("threshold", threshold, 0, low_open=True)

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        # arithmetic, not masked writes (several times faster): τ > 0, so at most one is set
        codes = ((flat >= self.threshold).to(torch.uint8) * POSITIVE
                 | (flat <= -self.threshold).to(torch.uint8) * NEGATIVE)
        return [wire.pack_bits(codes, 2)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        codes = wire.unpack_bits(payload[0], 2, torch.Size(shape).numel())
        # sgn = high bit · (2·low bit − 1): 3 → +1, 2 → −1, 0 and 1 → 0 (byte arithmetic,
        # ~3× a table lookup)
        signs = (codes >> 1).view(torch.int8) * ((codes & 1).view(torch.int8) * 2 - 1)
        return signs.to(dtype).mul_(self.threshold).view(shape)

    def sent_mask(self, payload, ctx):
        """Sent = quantised to ±τ; a 0 code means "keep accumulating" (for masking memories)."""
        shape, _ = ctx
        return (wire.unpack_bits(payload[0], 2, torch.Size(shape).numel()) >= NEGATIVE).view(shape)
