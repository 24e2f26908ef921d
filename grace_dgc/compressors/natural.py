import sys

import torch
from torch import Tensor

from .. import kernels, wire
from ..interfaces import Payload
from ..registry import register_compressor
from .packed import Shaped
from .stochastic import StochasticCompressor

MANTISSA_BITS = 23
INF_BITS = 0x7F800000  # fp32 bits of +inf; larger magnitudes are NaN
MAX_EXPONENT = 254  # of the largest finite power of two, 2**127


@register_compressor("natural", aliases=("natural_cuda",))  # GRACE's CUDA-kernel name
class NaturalCompressor(StochasticCompressor):
    """Natural compression (Horváth et al. 2019): unbiased rounding to ±2^k; 8-bit exponent + sign bit.

    Stochastic rounding of each element to one of the two nearest powers of two:

        C_nat(t) = sgn(t) · 2^⌊log2|t|⌋ · (1 + λ),   λ ~ Bernoulli(p),
        p = (|t| − 2^⌊log2|t|⌋) / 2^⌊log2|t|⌋,

    so E[C_nat(t)] = t (unbiased) and E[C_nat(t)²] ≤ (9/8)·t² (ω = 1/8).

    On fp32 bits this is exact integer arithmetic: |t| = 2^(e−127)·(1 + m/2²³), so
    p = m/2²³ and rounding up is e + 1. Adding u ~ U{0, …, 2²³−1} to the bits of |t| carries
    into the exponent iff u ≥ 2²³ − m, i.e. with probability exactly m/2²³, so the rounded
    exponent is (bits(|t|) + u) >> 23 (one add, one shift). It also holds below 2^−126
    (subnormals round to 0 or 2^−126 with p = m/2²³, still unbiased), and 0 (e = m = 0)
    never rounds up, so zeros round-trip exactly. Unbiased on |t| ≤ 2^127: beyond, the
    result saturates at 2^127 rather than overflowing to inf; ±inf and NaN travel as ±inf.
    Inputs of other dtypes are rounded in fp32 and the result cast back (fp16: a value in
    (2^15, 65504] that rounds up to 2^16 becomes inf in that cast).

    Wire: the 8-bit exponent e per element (uint8, e = 0 means zero) + the sign bits packed
    8 per byte (wire.pack_bits): n + ⌈n/8⌉ bytes, ≤ 9 bits per element. Codes cannot be
    summed: allgather or broadcast.

    Plain reference: ``tests/core/test_quantizers.py::two_point_reference`` (``2**floor(log2|x|)``
    in float64, where this code reads the exponent bits): outputs are exactly one of the two
    bracketing powers of two in ``test_natural_outputs_signed_powers_of_two_bracketing_the_input``,
    with the special values (±0, subnormals, 2¹²⁷ saturation, ±inf, NaN) written out there.
    """

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        bits = tensor.reshape(-1).float().view(torch.int32)
        n, scratch, device = bits.numel(), self.workspace, bits.device
        exponent = torch.empty(n, dtype=torch.uint8, device=device)
        # one draw of n before the chunks run (at once): the stream of the reference code
        draws = torch.randint(
            0,
            1 << MANTISSA_BITS,
            (n,),
            dtype=torch.int32,
            device=device,
            generator=self.generator(name, tensor.device),
            out=scratch.get("draws", n, torch.int32, device),
        )
        fused = kernels.attempt(
            lambda: kernels.natural_encode(bits.view(torch.float32), draws, exponent), device, kernel="natural"
        )
        if fused is not None:
            return [exponent, fused], (tensor.shape, tensor.dtype)

        def encode(start: int, stop: int) -> Tensor:
            """Exponents of the chunk and its sign bits, all in integer passes."""
            size, part = stop - start, bits[start:stop]
            magnitude = torch.bitwise_and(part, 0x7FFFFFFF, out=scratch.get("magnitude", size, torch.int32, device))
            finite = torch.sub(magnitude, INF_BITS, out=scratch.get("finite", size, torch.int32, device))
            finite.bitwise_right_shift_(31)  # −1 where finite, else 0
            magnitude.clamp_(max=INF_BITS)  # NaN → inf: the add below cannot overflow int32
            rounded = draws[start:stop].add_(magnitude)  # this chunk's draws, consumed in place
            rounded.bitwise_right_shift_(MANTISSA_BITS)  # 255 for inf and NaN
            # finite inputs saturate at 2^127 instead of carrying into inf: min(e, 254), and
            # 255 for inf and NaN (min(255, 254) + 1)
            exponent[start:stop].copy_(rounded.clamp_(max=MAX_EXPONENT).add_(finite).add_(1))
            # the sign bits: bit 7 of each fp32's high byte (little-endian)
            high_bytes = part.view(torch.uint8)[3::4] if sys.byteorder == "little" else part.view(torch.uint8)[::4]
            return torch.bitwise_right_shift(high_bytes, 7, out=scratch.get("negative", size, torch.uint8, device))

        return [exponent, wire.pack_chunks(n, 1, encode, device, scratch)], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        exponent, signs = payload
        n, scratch, device = exponent.numel(), self.workspace, exponent.device
        direct = out.dtype == torch.float32
        flat = out.view(-1)
        if n and kernels.enabled(device, kernel="natural"):  # one pass (another dtype: through fp32)
            target = flat if direct else scratch.get("decoded", n, torch.float32, device)
            if kernels.attempt(lambda: kernels.natural_decode(exponent, signs, target), device) is not None:
                return out if direct else out.copy_(target.view(out.shape))

        def decode(start: int, stop: int, negative: Tensor) -> None:
            size = stop - start
            word = flat[start:stop].view(torch.int32) if direct else scratch.get("word", size, torch.int32, device)
            sign = scratch.get("sign", size, torch.int32, device).copy_(negative)
            word.copy_(exponent[start:stop]).bitwise_left_shift_(MANTISSA_BITS)
            word.bitwise_or_(sign.bitwise_left_shift_(31))
            if not direct:
                flat[start:stop].copy_(word.view(torch.float32))

        wire.unpack_chunks(signs, 1, n, decode, scratch)
        return out
