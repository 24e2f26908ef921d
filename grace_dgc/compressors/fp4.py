import torch
from torch import Tensor

from .. import wire
from ..interfaces import Payload
from ..registry import register_compressor
from .packed import PackedCompressor, Shaped

SIGN = 8  # bit 3 of a code; bits 0-2 the exponent field
FIELDS = 7  # exponent fields 1..7 stand for s·2^(e−7); 0 for zero


@register_compressor("fp4", aliases=("e3m0", "fp4_e3m0"))
class FP4Compressor(PackedCompressor):
    """FP4 E3M0 (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512, its outer
    gradients "in 4 bits"): a sign and a 3-bit exponent, no mantissa, under a per-tensor
    power-of-two scale.

        s = 2^⌈log2 max|x|⌉,   m_i = |x_i| / s ∈ [0, 1]
        code_i = sign_i·8 + e_i,   e_i ∈ {0, 1, …, 7}:  e = 0 is 0, e ≥ 1 is s·2^(e−7)
        e_i = the nearest of those 8 magnitudes to m_i (ties up: 2^k at m ≥ 1.5·2^(k−1);
              the smallest, 2^−6, from m ≥ 2^−7)

    Deterministic rounding to nearest: biased, as the paper's cast is. The per-tensor scale
    keeps the largest element representable; magnitudes below s·2^−7 travel as 0.

    Wire: the 4-bit codes packed two per byte (wire.pack_bits), then s as one fp32:
    ⌈n/2⌉ + 4 bytes. Codes under different scales cannot be summed: allgather or broadcast.

    Plain reference: ``tests/core/test_chain.py::reference_fp4`` (the nearest of the 15 values
    found by a search over all of them, per element).
    """

    biased = True

    SETTINGS = ()

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()
        peak = flat.abs().amax() if flat.numel() else flat.new_zeros(())
        scale = torch.where(peak > 0, torch.exp2(torch.ceil(torch.log2(peak))), torch.ones_like(peak))
        mantissa, exponent = torch.frexp(flat.abs() / scale)  # m = f·2^q, f ∈ [0.5, 1)
        field = exponent.add_(FIELDS - 1).add_(mantissa.ge(0.75).to(torch.int32))  # nearest of 2^(q−1), 2^q
        small = field.lt(1).logical_or_(mantissa.eq(0))  # below 2^−6 (or 0): 2^−6 from 2^−7 on, else 0
        field = torch.where(small, (flat.abs() >= scale * 2.0**-7).to(torch.int32), field).clamp_(0, FIELDS)
        codes = field.add_(flat.signbit().to(torch.int32).mul_(SIGN)).to(torch.uint8)
        return [wire.pack_bits(codes, 4), scale.view(1)], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        packed, scale = payload
        codes = wire.unpack_bits(packed, 4, out.numel()).to(torch.int32)
        field = codes.bitwise_and(FIELDS)
        magnitude = torch.where(field > 0, torch.exp2((field - FIELDS).float()) * scale, torch.zeros_like(scale))
        out.view(-1).copy_(torch.where(codes >= SIGN, -magnitude, magnitude))
        return out
