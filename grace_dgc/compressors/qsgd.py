import math
from collections.abc import Callable

import torch
from torch import Tensor

from .. import kernels, wire
from ..errors import check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import Workspace, for_chunks
from .packed import Shaped
from .stochastic import StochasticCompressor


def scaled_norms(rows: Tensor) -> Tensor:
    """Each row's ‖v‖₂ as m·‖v/m‖₂ with m = max|v|: no overflow for any finite row (|v| up to
    fp32's maximum); a row with NaN or Inf still gives NaN or Inf."""
    scale = rows.abs().amax(dim=1, keepdim=True)
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, 1.0)
    return (rows / scale).norm(dim=1) * scale.squeeze(1)


def repair_norms(norms: Tensor, rows: Tensor, host_reads: bool | None = None) -> None:
    """Where ‖v‖² overflowed fp32 (or v holds NaN/Inf), each row's :func:`scaled_norms` in
    ``norms``. With ``host_reads`` (the default on a CPU, where a read costs nothing) only those
    rows' are computed; without (other devices) every row's, and a select picks, so no host read
    waits for the GPU."""
    reads = rows.device.type == "cpu" if host_reads is None else host_reads
    if not reads:
        norms.copy_(torch.where(torch.isfinite(norms), norms, scaled_norms(rows)))
    elif (overflowed := torch.nonzero(~torch.isfinite(norms)).view(-1)).numel():
        norms[overflowed] = scaled_norms(rows[overflowed])


def stochastic_round_(x: Tensor, uniform: Tensor, workspace: Workspace) -> Tensor:
    """⌊x⌋ + Bernoulli(x − ⌊x⌋) for x ≥ 0 with ``uniform`` ~ U[0, 1) of x's shape: an unbiased
    integer, E = x. Overwrites x and ``uniform``; the result is the workspace's "floor" buffer."""
    floor = torch.floor(x, out=workspace.get("floor", x.numel(), x.dtype, x.device).view(x.shape))
    fraction = x.sub_(floor)
    return floor.add_(uniform.lt_(fraction))  # in place: large tensors, few passes


def quantize_codes(block: Tensor, uniform: Tensor, factor: Tensor, s: int, out: Tensor, workspace: Workspace) -> None:
    """``out`` (uint8 or int64) = s + sgn(v)·ξ for the first out.numel() elements of ``block``
    (fp32 [rows, size], a short last bucket zero-padded): ξ = ⌊u⌋ + Bernoulli(u − ⌊u⌋), u =
    min(|v|·factor_row, s), ``factor`` = s/‖v‖ per row and ``uniform`` ~ U[0, 1) of block's
    shape. One fused kernel where the kernels run (:func:`grace_dgc.kernels.qsgd_codes`: the
    uniforms are only read, so a failed launch leaves them for the torch ops), else the torch
    ops (which overwrite ``uniform``); the same codes either way."""
    launch = lambda: kernels.qsgd_codes(block, uniform, factor, s, block.shape[1], out)  # noqa: E731
    if kernels.attempt(launch, block.device, block.dtype) is not None:
        return
    scaled = torch.abs(block, out=workspace.get("scaled", block.numel(), torch.float32, block.device).view(block.shape))
    scaled.mul_(factor.unsqueeze(1))
    levels = stochastic_round_(scaled.clamp_(max=s), uniform, workspace)
    signed = torch.copysign(levels, block, out=scaled).add_(s)  # in [0, 2s]
    out.copy_(signed.view(-1)[: out.numel()])


@register_compressor("qsgd", aliases=("qsgd_cuda",))  # GRACE's CUDA-kernel name
class QSGDCompressor(StochasticCompressor):
    """QSGD (Alistarh et al. 2017): unbiased stochastic levels, ⌈log2(2s+1)⌉ bits/element + bucket norms.

    s = ``quantum_num`` levels, per bucket of ``bucket_size`` elements (the last bucket may
    be shorter):

        Q_s(v_i) = ‖v‖₂ · sgn(v_i) · ξ_i(v, s) / s,
        ξ_i = l + 1 with probability |v_i|/‖v‖₂ · s − l, else l,   l = ⌊|v_i|/‖v‖₂ · s⌋,

    so E[Q_s(v)] = v (unbiased), Var ≤ min(n/s², √n/s)·‖v‖² per bucket (paper, Lemma 3.1).

    Wire: the signed level sgn(v_i)·ξ_i ∈ [−s, s], offset by +s, packed into
    b = ⌈log2(2s+1)⌉ bits per element (wire.pack_bits), plus one fp32 ‖v‖₂ per bucket:
    ⌈n·b/8⌉ + 4·⌈n/bucket_size⌉ bytes. Default s = 64 (b = 8); s = 127 (GRACE's helper
    default, used by grace_dgc.compat) is the finest that still fits 8 bits. A bucket of zeros
    sends norm 0 and levels 0.

    On a GPU the per-element quantization and the decoding each run as one fused Triton kernel
    (:func:`grace_dgc.kernels.qsgd_codes`, ``qsgd_values``; the bucket norms and the factors
    s/‖v‖, ‖v‖/s stay torch's): one pass over memory instead of ten and three, the same
    bits as the torch ops.

    Plain reference: ``tests/core/test_quantizers.py::two_point_reference`` (float64): the exact
    levels ⌊·⌋ or ⌈·⌉ of |v|·s/‖v‖ in ``test_qsgd_exact_levels_and_zero_bucket``, unbiasedness
    in ``test_mean_of_many_draws_converges_to_the_input``; the packed codes round-trip against
    ``reference_pack`` (:func:`grace_dgc.wire.pack_bits`).
    """

    SETTINGS = ("quantum_num", "bucket_size", "seed")

    def __init__(self, quantum_num: int = 64, bucket_size: int = 512, seed: int = 0) -> None:
        super().__init__(seed)
        # levels are exact integers in the fp32 arithmetic below only up to 2**24
        self.quantum_num = check_range("quantum_num", quantum_num, 1, 2**23, kind=int)
        self.bucket_size = check_range("bucket_size", bucket_size, 1, kind=int)
        self.bits = math.ceil(math.log2(2 * self.quantum_num + 1))

    def for_row_chunks(
        self, body: Callable[[int, int, int, int], object], n: int, device: torch.device | str
    ) -> list[object]:
        """``body(first row, last row, first element, last element)`` for each chunk of whole
        buckets (the last bucket may be short), chunks at once on the CPU's workers
        (:func:`~grace_dgc.workspace.for_chunks`): the temporaries stay small and in cache."""
        rows = -(-n // self.bucket_size)
        return for_chunks(
            lambda start, stop: body(start // self.bucket_size, stop // self.bucket_size, start, min(stop, n)),
            rows * self.bucket_size,
            device,
            multiple=self.bucket_size,
        )

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()
        n, s, size, scratch = flat.numel(), self.quantum_num, self.bucket_size, self.workspace
        norms = flat.new_empty(-(-n // size))
        codes = torch.empty(n, dtype=torch.uint8 if self.bits <= 8 else torch.int64, device=flat.device)
        # one draw for every bucket, padding included, before the chunks run (at once): the
        # stream of the reference code
        padded = norms.numel() * size
        uniforms = torch.rand(
            padded,
            generator=self.generator(name, tensor.device),
            device=flat.device,
            out=scratch.get("uniforms", padded, torch.float32, flat.device),
        )

        def quantize(row: int, last_row: int, start: int, stop: int) -> None:
            block = scratch.get("block", (last_row - row) * size, torch.float32, flat.device)
            block[: stop - start].copy_(flat[start:stop])
            block[stop - start :].zero_()  # a short last bucket is zero-padded
            block = block.view(-1, size)
            norm = norms[row:last_row]
            norm.copy_(block.norm(dim=1))
            repair_norms(norm, block)
            # a zero-norm bucket has only zeros: divide by 1 instead (levels stay 0)
            factor = s / torch.where(norm > 0, norm, 1.0)
            uniform = uniforms[row * size : last_row * size].view(block.shape)
            quantize_codes(block, uniform, factor, s, codes[start:stop], scratch)

        self.for_row_chunks(quantize, n, flat.device)
        packed = codes if self.bits == 8 else wire.pack_bits(codes, self.bits, scratch)
        return [packed, norms], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        packed, norms = payload
        n, s, size = out.numel(), self.quantum_num, self.bucket_size
        codes = packed if self.bits == 8 else wire.unpack_bits(packed, self.bits, n, self.workspace)
        flat = out.view(-1)
        if n and kernels.enabled(out.device):  # one fused pass (a GPU: one chunk anyway)
            direct = out.dtype == torch.float32 and out.is_contiguous()
            target = flat if direct else self.workspace.get("decoded", n, torch.float32, out.device)
            if kernels.attempt(lambda: kernels.qsgd_values(codes, norms / s, s, size, target), out.device) is not None:
                return out if direct else out.copy_(target.view(out.shape))

        def dequantize(row: int, last_row: int, start: int, stop: int) -> None:
            whole = stop - start == (last_row - row) * size and out.dtype == torch.float32
            block = (
                flat[start:stop]
                if whole
                else self.workspace.get("block", (last_row - row) * size, torch.float32, out.device)
            )
            block[: stop - start].copy_(codes[start:stop])
            block[stop - start :].zero_()
            block.view(-1, size).sub_(s).mul_((norms[row:last_row] / s).unsqueeze(1))
            if not whole:
                flat[start:stop].copy_(block[: stop - start])

        self.for_row_chunks(dequantize, n, out.device)
        return out
