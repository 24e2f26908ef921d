import functools
import math

import numpy as np
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
        # every code is a function of the sign, the exponent E and the mantissa's top bit: all in the
        # fp32 bits' high half h. |x| = (1 + M/2^23)·2^(E−127) and m = |x|/s, so the nearest field is
        # E + (M ≥ 2^22) − 120 − k = ((h & 0x7FFF) + carry) >> 7: adding 2^6 carries that bit into E
        carry = (1 << 6) - ((120 + k) << 7)
        small_from = int(torch.tensor(2.0 ** (k - 7)).view(torch.int32)) >> 16  # s·2^−7's h: from it on, 2^−6
        bits = flat.detach().view(torch.int32).numpy()

        def encode(start: int, stop: int) -> Tensor:
            # int16 numpy passes in cache: half int32's bytes, and SIMD loops (torch's int32 ops: 1.5x the time)
            size, scratch = stop - start, self.workspace
            high, field, sign = (scratch.get(key, size, torch.int16, "cpu").numpy() for key in ("h", "field", "sign"))
            above = scratch.get("above", size, torch.bool, "cpu").numpy()
            codes = scratch.get("codes", size, torch.uint8, "cpu")
            np.right_shift(bits[start:stop], 16, out=high, casting="unsafe")
            np.bitwise_and(np.right_shift(high, 12, out=sign), SIGN, out=sign)  # the sign bit (15) to bit 3
            np.bitwise_and(high, 0x7FFF, out=high)
            np.right_shift(np.add(high, carry, out=field), 7, out=field)  # ≤ 7 with no clamp: |x| ≤ s, finite
            np.maximum(field, np.greater_equal(high, small_from, out=above), out=field)  # below 2^−6: 2^−6 or 0
            np.bitwise_or(field, sign, out=codes.numpy(), casting="unsafe")
            return codes

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
