import torch

from .. import wire
from ..registry import register_compressor
from .qsgd import StochasticCompressor

MANTISSA_BITS = 23
INF_BITS = 0x7F800000   # fp32 bits of +inf; larger magnitudes are NaN
INF_EXPONENT = 255      # fp32 biased exponent of inf / NaN
MAX_EXPONENT = 254      # of the largest finite power of two, 2**127


@register_compressor("natural")
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
    """

    def compress(self, tensor, name):
        bits = tensor.reshape(-1).float().view(torch.int32)
        magnitude = bits & 0x7FFFFFFF
        finite = magnitude < INF_BITS
        magnitude.clamp_(max=INF_BITS)      # NaN → inf: the add below cannot overflow int32
        uniform = torch.randint(0, 1 << MANTISSA_BITS, bits.shape, dtype=torch.int32, device=bits.device,
                                generator=self.generator(name, tensor.device))
        exponent = uniform.add_(magnitude).bitwise_right_shift_(MANTISSA_BITS).to(torch.uint8)
        # finite inputs saturate at 2^127 instead of carrying into inf
        exponent = torch.where(finite, exponent.clamp_(max=MAX_EXPONENT), INF_EXPONENT)
        return [exponent, wire.pack_bits(bits < 0, 1)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        exponent, signs = payload
        shape, dtype = ctx
        sign_bits = wire.unpack_bits(signs, 1, exponent.numel()).to(torch.int32).bitwise_left_shift_(31)
        bits = exponent.to(torch.int32).bitwise_left_shift_(MANTISSA_BITS).bitwise_or_(sign_bits)
        return bits.view(torch.float32).to(dtype).view(shape)
