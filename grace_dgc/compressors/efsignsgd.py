import torch

from .. import wire
from ..interfaces import Compressor
from ..registry import register_compressor


@register_compressor("efsignsgd")
class EFSignSGDCompressor(Compressor):
    """Scaled sign of EF-SignSGD, (‖p‖₁/d)·sign(p): 1 bit per element + one fp32

    Karimireddy, Rebjock, Stich & Jaggi 2019, "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", Algorithm 1:

        C(p) = (‖p‖₁ / d) · sign(p)            d = number of elements of p
        p_t = γ·g_t + e_t,   Δ_t = C(p_t),   x_{t+1} = x_t − Δ_t,   e_{t+1} = p_t − Δ_t

    This class is C; the error feedback lines are the memory ``efsignsgd`` (or the
    generic ``residual``). C keeps the L1 norm (‖C(p)‖₁ = ‖p‖₁) and is positively
    homogeneous (C(a·p) = a·C(p) for a > 0), which lets the memory carry γ.

    Wire: ⌈d/8⌉ bytes of packed sign bits (bit 1 ⇔ p_i ≥ 0) + the scale ‖p‖₁/d as one
    fp32 (4 bytes). Zero rule: an exact zero is sent as +1, so it comes back as +scale
    (an all-zero tensor has scale 0 and comes back as zeros; an empty one too).
    Aggregation: the average over ranks of the decompressed C(p_m) (``average = True``;
    GRACE sums instead). Sign bits cannot be summed: allgather or broadcast only.
    """

    def compress(self, tensor, name):
        numel = tensor.numel()
        # fp32 accumulation: the scale is one fp32 on the wire whatever the gradient dtype
        magnitude = torch.abs(tensor, out=self.workspace.like("abs", tensor))
        total = magnitude.sum(dtype=torch.float32)
        if not bool(torch.isfinite(total)):  # fp32 overflowed on finite values: sum in fp64
            total = magnitude.sum(dtype=torch.float64)
        scale = (total / max(numel, 1)).float()
        return [wire.pack_signs(tensor, self.workspace), scale.reshape(1)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        return self.decompress_into(payload, ctx, torch.empty(shape, dtype=dtype, device=payload[0].device))

    def decompress_into(self, payload, ctx, out):
        packed, scale = payload
        scale = float(scale)  # ±1 · scale is exactly ±scale
        return wire.unpack_select(packed, out, scale, -scale, self.workspace)

    def sent_mask(self, payload, ctx):
        # every element is sent (a sign, or a mean), even where it decodes to 0
        return torch.ones(ctx[0], dtype=torch.bool, device=payload[0].device)

    def mask_sent_(self, tensor, payload, ctx):
        return tensor.zero_()  # every element was sent
