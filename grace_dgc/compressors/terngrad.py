import torch

from .. import wire
from ..errors import check_range
from ..registry import register_compressor
from .qsgd import StochasticCompressor

# 2-bit codes: 0 → 0, 1 → +s, 2 → −s (3 is never sent, decodes to 0)
POSITIVE, NEGATIVE = 1, 2


@register_compressor("terngrad")
class TernGradCompressor(StochasticCompressor):
    """TernGrad (Wen et al. 2017): clip at c·σ, unbiased ternary {−s, 0, s}; 2 bits/element + fp32 s.

    Per tensor, with the paper's gradient clipping (§3.3, c = ``clip_factor`` = 2.5):

        σ = sqrt(mean((g − mean g)²)),   ĝ = clip(g, −c·σ, c·σ),
        s = max_i |ĝ_i|,   b_i ~ Bernoulli(|ĝ_i| / s),   t_i = s · sgn(ĝ_i) · b_i,

    so E[t] = ĝ: unbiased for the clipped gradient (the clipping itself is the paper's
    deliberate bias, trading outliers for a smaller s and variance). σ is the population
    standard deviation, as in the authors' TensorFlow code. If σ = 0 (a constant tensor,
    e.g. a single element) nothing is clipped: clipping removes outliers and a constant
    tensor has none, whereas the literal rule would send 0. ``clip_factor=inf`` disables
    clipping.

    Wire: 2 bits per element (wire.pack_bits, 4 per byte) + s as one fp32:
    ⌈n/4⌉ + 4 bytes. Codes cannot be summed: allgather or broadcast.
    """

    def __init__(self, clip_factor=2.5, seed=0):
        super().__init__(seed)
        self.clip_factor = check_range("clip_factor", clip_factor, 0, low_open=True)

    def compress(self, tensor, name):
        flat = tensor.reshape(-1).float()
        if flat.numel():
            sigma = flat.std(correction=0)
            bound = torch.where(sigma > 0, self.clip_factor * sigma, torch.inf)
            flat = flat.clamp(-bound, bound)
        magnitude = flat.abs()
        scale = magnitude.max().reshape(1) if flat.numel() else flat.new_zeros(1)
        probability = magnitude.div_(torch.where(scale > 0, scale, 1.0))
        generator = self.generator(name, tensor.device)
        uniform = torch.rand(flat.shape, generator=generator, device=flat.device)
        sent = (uniform < probability).to(torch.uint8)     # b_i; never where g_i = 0
        codes = sent.mul_((flat < 0).to(torch.uint8).add_(POSITIVE))   # NEGATIVE = POSITIVE + 1
        return [wire.pack_bits(codes, 2), scale], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        packed, scale = payload
        shape, dtype = ctx
        codes = wire.unpack_bits(packed, 2, torch.Size(shape).numel())
        # sgn = low bit − high bit: 1 → +1, 2 → −1, 0 and 3 → 0 (byte arithmetic, ~3× a lookup)
        signs = (codes & 1).view(torch.int8) - (codes >> 1).view(torch.int8)
        return signs.to(dtype).mul_(scale.to(dtype)).view(shape)
