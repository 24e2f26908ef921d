import torch
from torch import Tensor

from .. import kernels, wire
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import compare
from .packed import PackedCompressor, Shaped, narrow_or_wide


def _mean(values: Tensor, count: Tensor, host_reads: bool | None = None) -> Tensor:
    """Σ values / max(count, 1) as fp32: from the fp32 sum, or from the fp64 sum where the fp32
    one overflows on finite values (the mean is then still finite); read or selected as
    :func:`~grace_dgc.compressors.packed.narrow_or_wide` decides (no host read on a GPU)."""
    divisor = count.clamp(min=1)
    return narrow_or_wide(lambda dtype: (values.sum(dtype=dtype) / divisor).float(), values.device, host_reads)


@register_compressor("onebit", aliases=("1bit",))
class OneBitCompressor(PackedCompressor):
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

    Plain reference: ``tests/core/test_sign.py::ref_onebit`` and ``ref_packed`` (numpy, no bit
    masks): the packed bits equal them bit for bit and the means to fp32 rounding in
    ``test_onebit_wire_and_means`` (hypothesis), the hand-made cases in ``test_exact_hand_values``.
    """

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    chunkable = True
    sends_all = True  # a sign (or a mean) for every element, even one that decodes to 0

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()  # means are computed and sent in fp32
        n, scratch, device = flat.numel(), self.workspace, flat.device
        bits = flat.view(torch.int32)
        # where(P, g, 0) on the fp32 bits: g's bits & −P (all ones on P), made chunk by chunk
        # while the sign bits are packed; then where(P, 0, g) = g ⊕ where(P, g, 0). The sums
        # run over the whole tensor, as torch.where(...).sum() did: the same bits.
        picked = scratch.get("picked", n, torch.int32, device)
        counts = [flat.new_zeros((), dtype=torch.int64)]  # per chunk (chunks run at once)

        def encode(start: int, stop: int) -> Tensor:
            positive = compare("ge", flat[start:stop], 0, scratch.get("positive", stop - start, torch.bool, device))
            counts.append(torch.count_nonzero(positive))
            picked[start:stop].copy_(positive).neg_().bitwise_and_(bits[start:stop])
            return positive

        packed = None
        fused = kernels.attempt(lambda: kernels.sign_split(flat, picked), device) if n else None
        if fused is not None:  # a GPU: the bits, picked and the count in one pass
            packed, count = fused
            counts.append(count)
        if packed is None:
            packed = wire.pack_chunks(n, 1, encode, device, scratch)
        count_pos = torch.stack(counts).sum().to(torch.float32)  # exact at any size
        count_neg = n - count_pos
        positive_mean = _mean(picked.view(torch.float32), count_pos)
        negative_mean = _mean(picked.bitwise_xor_(bits).view(torch.float32), count_neg)
        return [packed, torch.stack([negative_mean, positive_mean])], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        packed, means = payload  # the means stay on the device: no host read
        return wire.unpack_select(packed, out, means[1], means[0], self.workspace)
