import torch

from .. import wire
from ..interfaces import Compressor
from ..registry import register_compressor


@register_compressor("onebit", aliases=("1bit",))
class OneBitCompressor(Compressor):
    """1-bit SGD: sign bits + the means of the non-negative and of the negative entries

    Seide, Fu, Droppo, Li & Yu 2014, "1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs":

        P = { i : g_i ≥ 0 },   N = { i : g_i < 0 }
        μ₊ = (1/|P|) Σ_{i∈P} g_i,   μ₋ = (1/|N|) Σ_{i∈N} g_i     (0 for an empty group)
        Q(g)_i = μ₊ if i ∈ P else μ₋

    with error feedback ("quantization with error feedback", the paper's key step), which
    is the ``residual`` memory: build("onebit", "residual", ...). Without it the
    quantization error is lost each step and training degrades, as the paper shows.

    μ₊ and μ₋ are the reconstruction values that minimise the squared error of each
    group, so Σ_i Q(g)_i = Σ_i g_i: the sum of the tensor is sent exactly.
    Granularity: one pair of means per tensor (as GRACE), not per matrix column as in the
    paper's implementation.

    Wire: ⌈n/8⌉ bytes of packed sign bits (bit 1 ⇔ g_i ≥ 0) + [μ₋, μ₊] as two fp32
    (8 bytes). Zero rule: an exact zero belongs to P (bit 1) and counts in μ₊, as in
    GRACE. Aggregation: the average over ranks of Q(g_m) (``average = True``); sign bits
    cannot be summed, so allgather or broadcast only.
    """

    def compress(self, tensor, name):
        flat = tensor.reshape(-1).float()      # means are computed and sent in fp32
        n, scratch = flat.numel(), self.workspace
        positive = torch.ge(flat, 0, out=scratch.get("positive", n, torch.bool, flat.device))
        count_pos = torch.count_nonzero(positive).to(torch.float32)     # exact at any size
        count_neg = n - count_pos
        # where(P, g, 0) and where(P, 0, g) on the fp32 bits (mask = −P: all ones on P), then
        # the same full-tensor sums: several times faster than torch.where, the same bits
        picked = scratch.get("picked", n, torch.int32, flat.device).copy_(positive).neg_()
        bits = flat.view(torch.int32)
        sum_pos = picked.bitwise_and_(bits).view(torch.float32).sum()
        sum_neg = picked.bitwise_xor_(bits).view(torch.float32).sum()
        means = torch.stack([sum_neg / count_neg.clamp(min=1), sum_pos / count_pos.clamp(min=1)])
        return [wire.pack_bits(positive, 1, scratch), means], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        return self.decompress_into(payload, ctx, torch.empty(shape, dtype=dtype, device=payload[0].device))

    def decompress_into(self, payload, ctx, out):
        packed, means = payload
        negative_mean, positive_mean = means.tolist()
        return wire.unpack_select(packed, out, positive_mean, negative_mean, self.workspace)

    def sent_mask(self, payload, ctx):
        # every element is sent (a sign, or a mean), even where it decodes to 0
        return torch.ones(ctx[0], dtype=torch.bool, device=payload[0].device)
