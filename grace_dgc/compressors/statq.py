import math

import torch
from torch import Tensor

from .. import wire
from ..errors import GraceConfigError, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from .packed import PackedCompressor, Shaped

BITS = (1, 2, 4, 8)


@register_compressor("statq", aliases=("statistical",))
class StatisticalQuantizer(PackedCompressor):
    """Statistical quantization (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706): b-bit codes
    on a grid scaled by the tensor's standard deviation, decoded to each bin's mean.

    With L = 2^b levels, μ the mean and σ the unbiased standard deviation of x:

        c = x − μ,   s = ρ·σ / L   (ρ = ``range_sigmas``; s = 1 where σ = 0 or is not finite)
        q_i = clamp(round(c_i / s + L/2), 0, L − 1)          (round half to even)
        T_j = mean{ c_i : q_i = j }  (0 for an empty bin),    D(q)_i = T_{q_i} + μ

    so the grid spans about ±ρ/2 σ and each code decodes to the mean of the values it
    stands for (the least-squares value for that bin). Biased (E[D(q)] ≠ x): meant for error
    feedback, as SparseLoCo uses it on top-k's values (``chunk_topk>statq``).

    Wire: the codes packed b bits each (wire.pack_bits), then L + 1 fp32 numbers (μ, then
    T_0 … T_{L−1}): ⌈n·b/8⌉ + 4(L + 1) bytes. The table is per tensor, so payloads cannot be
    summed: allgather or broadcast.

    Plain reference: ``tests/core/test_chain.py::reference_statq`` (a Python loop over the bins in
    float64, then fp32) equal code for code and value for value.
    """

    biased = True

    SETTINGS = ("bits", "range_sigmas")

    def __init__(self, bits: int = 2, range_sigmas: float = 6.0) -> None:
        if bits not in BITS or isinstance(bits, bool):
            raise GraceConfigError(f"bits={bits!r} is out of range; accepted: {', '.join(map(str, BITS))}")
        self.bits = int(bits)
        self.range_sigmas = check_range("range_sigmas", range_sigmas, 0, low_open=True)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()
        levels, n = 1 << self.bits, flat.numel()
        shift = flat.mean() if n else flat.new_zeros(())
        centered = flat - shift
        sigma = centered.norm() / math.sqrt(n - 1) if n > 1 else flat.new_zeros(())
        scale = sigma * (self.range_sigmas / levels)
        scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
        codes = centered.div(scale).add_(levels // 2).round_().clamp_(0, levels - 1).to(torch.uint8)
        slots = codes.long()
        sums = torch.zeros(levels, device=flat.device).index_add_(0, slots, centered)
        counts = torch.bincount(slots, minlength=levels).to(torch.float32)
        table = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
        return [wire.pack_bits(codes, self.bits), torch.cat([shift.view(1), table])], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        packed, header = payload
        codes = wire.unpack_bits(packed, self.bits, out.numel()).long()
        out.view(-1).copy_(header[1:].index_select(0, codes).add_(header[0]))
        return out
