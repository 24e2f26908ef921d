import torch
from torch import Tensor

from .. import kernels, wire
from ..errors import check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import compare
from .packed import PackedCompressor, Shaped

# 2-bit codes, as in MXNet: 00 → 0, 11 → +τ, 10 → −τ (01 is never sent, decodes to 0)
NEGATIVE, POSITIVE = 2, 3


@register_compressor("twobit", aliases=("2bit",))
class TwoBitCompressor(PackedCompressor):
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

    Plain reference: the codes and their little-endian bit layout written out by hand in
    ``tests/core/test_quantizers.py::test_twobit_values_and_bit_layout_by_hand`` (bit for bit), the
    error-feedback loop in ``test_twobit_with_residual_is_mxnet_error_feedback``; the packing
    itself against ``reference_pack`` (see :func:`grace_dgc.wire.pack_bits`).
    """

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    chunkable = True
    SETTINGS = ("threshold",)

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = check_range("threshold", threshold, 0, low_open=True)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1)
        scratch = self.workspace
        launch = lambda: kernels.pack_ternary(flat, self.threshold)  # noqa: E731
        fused = kernels.attempt(launch, flat.device, flat.dtype) if flat.numel() else None
        if fused is not None:  # a GPU: compare and pack in one pass
            return [fused], (tensor.shape, tensor.dtype)

        def encode(start: int, stop: int) -> Tensor:
            # arithmetic on byte masks, not masked writes: τ > 0, so at most one is set
            part, size = flat[start:stop], stop - start
            codes = compare("ge", part, self.threshold, scratch.get("up", size, torch.bool, flat.device))
            down = compare("le", part, -self.threshold, scratch.get("down", size, torch.bool, flat.device))
            return codes.view(torch.uint8).mul_(POSITIVE).bitwise_or_(down.view(torch.uint8).mul_(NEGATIVE))

        return [wire.pack_chunks(flat.numel(), 2, encode, flat.device, scratch)], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        table = [0.0, 0.0, -self.threshold, self.threshold]  # ±τ as fp32, then out's dtype: torch's rounding
        if out.dtype in kernels.FLOATS and wire.lookup_fused(payload[0], 2, out, table, self.workspace):
            return out  # a GPU: codes to values in one pass (2 → −τ, 3 → +τ, 0 and 1 → 0)
        if wire.lookup_bytes(payload[0], 2, torch.tensor(table), out, self.workspace):
            return out  # a CPU into fp32: a byte's four values in one row lookup
        flat = out.view(-1)

        def decode(start: int, stop: int, codes: Tensor) -> None:
            # sgn = high bit · (2·low bit − 1): 3 → +1, 2 → −1, 0 and 1 → 0 (byte arithmetic,
            # ~3× a table lookup); the codes are a scratch of unpack_chunks, reused in place
            low = torch.bitwise_and(codes, 1, out=self.workspace.get("low", stop - start, torch.uint8, out.device))
            signs = codes.bitwise_right_shift_(1).view(torch.int8).mul_(low.view(torch.int8).mul_(2).sub_(1))
            flat[start:stop].copy_(signs).mul_(self.threshold)

        wire.unpack_chunks(payload[0], 2, out.numel(), decode, self.workspace)
        return out

    def sent_mask(self, payload: Payload, ctx: Shaped) -> Tensor:
        """Sent = quantised to ±τ; a 0 code means "keep accumulating" (for masking memories)."""
        shape, _ = ctx
        return (wire.unpack_bits(payload[0], 2, torch.Size(shape).numel(), self.workspace) >= NEGATIVE).view(shape)
