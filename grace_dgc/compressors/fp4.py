import functools
import math

import torch
from torch import Tensor

from .. import kernels, wire
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import for_chunks
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
        low, high = torch.aminmax(flat) if flat.numel() else (flat.new_zeros(()), flat.new_zeros(()))
        peak = torch.maximum(high, low.neg())  # max|x| in one read, no |x| temporary (NaN stays NaN)
        scale = torch.where(peak > 0, torch.exp2(torch.ceil(torch.log2(peak))), torch.ones_like(peak))
        fused = kernels.attempt(lambda: kernels.fp4_encode(flat, scale.view(1)), flat.device, kernel="fp4")
        if fused is not None:  # one pass on the device, s read there: no host sync
            return [fused, scale.view(1)], (tensor.shape, tensor.dtype)
        k = _power_of_two(scale) if flat.device.type == "cpu" and math.isfinite(peak) else None  # host reads: CPU
        if k is None:  # a GPU, a non-finite peak, or a scale near fp32's ends: the elementwise ops
            return [wire.pack_bits(_codes(flat, scale), 4), scale.view(1)], (tensor.shape, tensor.dtype)
        small_from = int(torch.tensor(2.0 ** (k - 7)).view(torch.int32))  # s·2^−7's bits: |x| ≥ it rounds to 2^−6
        carry = (1 << 22) - ((120 + k) << 23)

        def encode(start: int, stop: int) -> Tensor:
            # on the fp32 bits, in cache: |x| = (1 + M/2^23)·2^(E−127) and m = |x|/s, so the nearest
            # field is E + (M ≥ 2^22) − 120 − k; adding 2^22 carries that top mantissa bit into E
            bits, size, scratch = flat[start:stop].view(torch.int32), stop - start, self.workspace
            magnitude = torch.bitwise_and(bits, 0x7FFFFFFF, out=scratch.get("mag", size, torch.int32, flat.device))
            field = torch.add(magnitude, carry, out=scratch.get("field", size, torch.int32, flat.device))
            field.bitwise_right_shift_(23)  # ≤ 7 with no clamp: |x| ≤ s, finite (k is None otherwise)
            field = torch.maximum(field, magnitude.ge_(small_from), out=field)  # below 2^−6: 2^−6 from 2^−7 on, else 0
            # the sign bit into bit 3: an arithmetic shift by 28 brings bit 31 to bit 3 (a bool mask
            # and an add with alpha cost 5x these two int32 ops)
            sign = torch.bitwise_right_shift(bits, 28, out=scratch.get("sign", size, torch.int32, flat.device))
            return field.bitwise_or_(sign.bitwise_and_(SIGN))

        packed = wire.pack_chunks(flat.numel(), 4, encode, flat.device, self.workspace)
        return [packed, scale.view(1)], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        packed, scale = payload
        if out.dtype == torch.float32 and out.is_contiguous():
            fused = kernels.attempt(lambda: kernels.fp4_decode(packed, scale, out.view(-1)), out.device, kernel="fp4")
            if fused is not None:
                return out
        k = _power_of_two(scale) if out.device.type == "cpu" else None
        if k is None or out.dtype != torch.float32 or not out.is_contiguous():
            codes = wire.unpack_bits(packed, 4, out.numel()).to(torch.int32)
            field = codes.bitwise_and(FIELDS)
            magnitude = torch.where(field > 0, torch.exp2((field - FIELDS).float()) * scale, torch.zeros_like(scale))
            out.view(-1).copy_(torch.where(codes >= SIGN, -magnitude, magnitude))
            return out
        n, flat = out.numel(), out.view(-1)
        pairs, table = n // 2, _pair_table(k)  # a byte holds two codes: one lookup writes both values
        pairs_out = flat[: 2 * pairs].view(torch.int64)

        def decode(start: int, stop: int) -> None:
            index = self.workspace.get("index", stop - start, torch.int32, out.device)
            torch.index_select(table, 0, index.copy_(packed[start:stop]), out=pairs_out[start:stop])

        for_chunks(decode, pairs, out.device)
        if n % 2:  # the last code, alone in its byte's low half
            flat[-1:].view(torch.int32).copy_(table[packed[pairs:].to(torch.int64) & 15].to(torch.int32))
        return out


@functools.cache
def _pair_table(k: int) -> Tensor:
    """The fp32 bits of the two values a byte of codes stands for under s = 2^k, as one int64
    per byte (the low half's code first, as the bytes lie in memory): ±s·2^(e−7) is a power of
    two, its bits the sign and the exponent e + 120 + k; code 0 is +0, code 8 is −0."""
    codes = torch.arange(16, dtype=torch.int64)
    field = codes & FIELDS
    words = torch.where(field > 0, (field + 120 + k) << 23, 0) | ((codes & SIGN) << 28)
    byte = torch.arange(256, dtype=torch.int64)
    return words[byte & 15] | (words[byte >> 4] << 32)


def _power_of_two(scale: Tensor) -> int | None:
    """k of a scale s = 2^k whose codes' values s·2^−7 … s are normal fp32 numbers (the bit
    paths above hold there); None otherwise (a non-finite peak, or s beyond 2^±100)."""
    value = float(scale.reshape(-1)[0])
    if not math.isfinite(value) or value <= 0:
        return None
    k = math.frexp(value)[1] - 1
    return k if -100 <= k <= 100 and value == 2.0**k else None


def _codes(flat: Tensor, scale: Tensor) -> Tensor:
    """The codes by elementwise ops (any device, any scale): the bit path's reference."""
    mantissa, exponent = torch.frexp(flat.abs() / scale)  # m = f·2^q, f ∈ [0.5, 1)
    field = exponent.add_(FIELDS - 1).add_(mantissa.ge(0.75).to(torch.int32))  # nearest of 2^(q−1), 2^q
    small = field.lt(1).logical_or_(mantissa.eq(0))  # below 2^−6 (or 0): 2^−6 from 2^−7 on, else 0
    field = torch.where(small, (flat.abs() >= scale * 2.0**-7).to(torch.int32), field).clamp_(0, FIELDS)
    # a NaN (or an infinity beside one, s = 1) is ±s: frexp's exponent there is each platform's own
    field.masked_fill_(~torch.isfinite(mantissa), FIELDS)
    return field.add_(flat.signbit().to(torch.int32).mul_(SIGN)).to(torch.uint8)
