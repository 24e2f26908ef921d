from typing import Any

import torch
from torch import Tensor

from .. import kernels, wire
from ..errors import check_range
from ..interfaces import Payload
from ..registry import register_compressor
from .packed import Shaped
from .stochastic import StochasticCompressor

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

    Plain reference: ``tests/core/test_quantizers.py::clipped_reference`` and
    ``two_point_reference`` (float64 torch, no bit codes): every output is 0 or ±s of the
    clipped input in ``test_terngrad_values_are_zero_or_signed_scale``, the mean of many draws
    converges to the input in ``test_mean_of_many_draws_converges_to_the_input``.
    """

    SETTINGS = ("clip_factor", "seed")

    def __init__(self, clip_factor: float = 2.5, seed: int = 0) -> None:
        super().__init__(seed)
        self.clip_factor = check_range("clip_factor", clip_factor, 0, low_open=True, allow_inf=True)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()
        n, scratch, device = flat.numel(), self.workspace, flat.device
        if not n:
            return [wire.pack_bits(flat.new_empty(0, dtype=torch.uint8), 2), flat.new_zeros(1)], (
                tensor.shape,
                tensor.dtype,
            )
        sigma = flat.std(correction=0)
        clip_bound = torch.where(sigma > 0, self.clip_factor * sigma, torch.inf)
        # max |clip(g)| = min(max |g|, bound): clipping is monotone, so no clipped copy is needed
        low, high = torch.aminmax(flat)
        scale = torch.minimum(torch.maximum(-low, high), clip_bound).reshape(1)
        divisor = torch.where(scale > 0, scale, 1.0)
        # one draw of n before the chunks run (at once): the stream of the reference code
        uniforms = scratch.get("uniforms", n, torch.float32, device)
        torch.rand(n, generator=self.generator(name, device), device=device, out=uniforms)
        launch = lambda: kernels.terngrad_encode(flat, uniforms, clip_bound.reshape(1), divisor)  # noqa: E731
        fused = kernels.attempt(launch, device, kernel="terngrad")
        if fused is not None:
            return [fused, scale], (tensor.shape, tensor.dtype)
        # on a CPU plain numbers (fp32 values): 0-d tensor operands broadcast slowly there; on a GPU
        # the device's tensors (a float() is a host sync)
        bound: Any = float(clip_bound) if device.type == "cpu" else clip_bound
        divide_by: Any = float(divisor) if device.type == "cpu" else divisor

        def encode(start: int, stop: int) -> Tensor:
            size = stop - start
            clipped = torch.clamp(
                flat[start:stop], -bound, bound, out=scratch.get("clipped", size, torch.float32, device)
            )
            # code − 1 = the sign bit (differs from ĝ < 0 only at −0.0 and NaN, never sent)
            code = torch.bitwise_right_shift(
                clipped.view(torch.int32), 31, out=scratch.get("code", size, torch.int32, device)
            )
            code.bitwise_and_(1).add_(POSITIVE)  # NEGATIVE = POSITIVE + 1
            probability = clipped.abs_().div_(divide_by).nan_to_num_(nan=0.0)
            uniform = uniforms[start:stop]  # this chunk's draws, consumed in place
            # b_i = [u < p]: the sign bit of u − p (exact: the difference of two floats in
            # [0, 1] is negative exactly when u < p), as an all-ones/zero integer mask
            sent = uniform.sub_(probability).view(torch.int32).bitwise_right_shift_(31)
            return scratch.get("codes", size, torch.uint8, device).copy_(code.bitwise_and_(sent))

        return [wire.pack_chunks(n, 2, encode, device, scratch), scale], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        packed, scale = payload
        if kernels.enabled(out.device, kernel="terngrad"):  # one pass: each code's sgn · s, as below
            if wire.lookup_fused(packed, 2, out, [scale * 0, scale, scale * -1, scale * 0], self.workspace):
                return out
        flat, scale = out.view(-1), scale.to(out.dtype)

        def decode(start: int, stop: int, codes: Tensor) -> None:
            # sgn = low bit − high bit: 1 → +1, 2 → −1, 0 and 3 → 0 (byte arithmetic, ~3× a lookup)
            high = torch.bitwise_right_shift(
                codes, 1, out=self.workspace.get("high", stop - start, torch.uint8, out.device)
            )
            signs = codes.bitwise_and_(1).view(torch.int8).sub_(high.view(torch.int8))
            flat[start:stop].copy_(signs).mul_(scale)

        wire.unpack_chunks(packed, 2, out.numel(), decode, self.workspace)
        return out
