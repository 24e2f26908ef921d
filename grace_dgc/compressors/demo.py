"""DeMo's compressor: top-k of a chunked orthonormal DCT-II (Peng, Quesnelle & Kingma 2024).

Read in the reference, github.com/bloc97/DeMo ``demo.py`` at 0e48145 (not copied):
  * defaults chunk 64, topk 32, decay 0.999 (l.24-26; also ``OLMo-*-demo.yaml``); topk, chunk ≥ 1
    (l.47-50);
  * a dimension of size s is cut in chunks of the largest divisor of s ≤ the target (s when
    s ≤ target, 1 for a prime above it): ``_get_smaller_split`` l.440-449, used l.189; a matrix
    in c₁×c₂ blocks, a vector in chunks of c (l.224, l.232);
  * orthonormal DCT-II along both axes of a block (separable 2-D DCT) or of a 1-D chunk, a
    product with the basis ``_dct(eye(c), norm="ortho")`` (l.195, l.199-204); inverse l.206-212;
  * top-k by magnitude of each block's flattened c₁·c₂ coefficients, k clamped to that size
    (l.266-271, l.283); sent: the values and their indices within the block (l.284; int64
    there, int32 here); the sender subtracts the IDCT of what it sent (l.140-145);
  * all ranks' (indices, values) are scattered with ``scatter_reduce("mean",
    include_self=False)`` (l.296, l.304-307): each coefficient is the mean over the ranks that
    *sent* it (0 where none did), not over all ranks; then the IDCT (l.156-157);
  * the update is the ``sign`` of that decoded aggregate (l.167), then SGD with momentum 0.
A tensor of 3+ dimensions (the reference takes 1-D and 2-D only) is the matrix shape[0] × rest.
"""

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import GraceConfigError, check_bool, check_range
from ..interfaces import Compressor, Payload
from ..registry import register_compressor
from ..workspace import for_chunks


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The transform runs in float64 for float64 tensors, else in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@lru_cache(maxsize=4096)
def chunk_of(size: int, target: int) -> int:
    """The largest divisor of ``size`` that is ≤ ``target`` (the reference's choice); 1 for 0."""
    return next(d for d in range(min(size, target), 0, -1) if size % d == 0) if size else 1


def dct_basis(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Orthonormal DCT-II matrix: C[k, j] = α_k·cos(π(2j+1)k / 2n), α_0 = √(1/n), else √(2/n);
    dct(x) = C·x and C⁻¹ = Cᵀ. Built in float64, then cast."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2 / n)
    basis[0] /= math.sqrt(2)
    return basis.to(dtype=dtype, device=device)


class DemoContext(NamedTuple):
    """The tensor as a rows × cols matrix (a vector: 1 × n) cut in c₁ × c₂ blocks, k sent each."""

    shape: torch.Size
    dtype: torch.dtype
    rows: int
    cols: int
    c1: int
    c2: int
    k: int

    @property
    def blocks(self) -> int:
        return (self.rows // self.c1) * (self.cols // self.c2)


@register_compressor("demo")
class DemoCompressor(Compressor):
    """DeMo (Peng, Quesnelle & Kingma 2024): top-k per block of a chunked DCT-II; sign of the senders' mean

    With the ``demo`` memory (m ← β·m + g before, m ← m − q after), per tensor and rank r:
      1. blocks: the tensor as a matrix cut into c₁×c₂ blocks, c = the largest divisor of the
         dimension ≤ ``chunk`` (a vector: chunks of c₂, c₁ = 1);
      2. M_b = C₁·m_b·C₂ᵀ, the orthonormal DCT-II of each block (C: :func:`dct_basis`);
      3. S_b = the k = min(``topk``, c₁c₂) largest |M_b|; payload = their values (the tensor's
         dtype) and int32 indices within the block, ``blocks·k`` of each;
      4. q_r = C₁ᵀ·M_b|S_b·C₂ per block (``decompress``): the memory subtracts it (m ← m − q_r);
      5. aggregate: Q[b, i] = mean of the values sent for coefficient (b, i) by the ranks that
         sent it (0 if none), u = IDCT(Q); the result is sign(u) (``sign=True``, the
         reference's update; 0 where u = 0) or u itself (``sign=False``).
    The result is already the step (a sign, or a mean): ``average = False``. Indices differ per
    rank, so payloads cannot be summed (allgather, broadcast); they index DCT coefficients, not
    the tensor (``sparse = False``); top-k per block of the whole tensor (``chunkable = False``).
    Use plain SGD (momentum 0): the memory is the momentum.
    """

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    SETTINGS = ("chunk", "topk", "sign")
    RANK_LOCAL = {
        **Compressor.RANK_LOCAL,
        "_bases": "DCT bases, a pure function of (size, dtype, device), built on first use",
    }
    average = False

    def __init__(self, chunk: int = 64, topk: int = 32, sign: bool = True) -> None:
        self.chunk = check_range("chunk", chunk, 1, kind=int)
        self.topk = check_range("topk", topk, 1, kind=int)
        if self.topk > self.chunk * self.chunk:  # name both: either may be the one to change
            raise GraceConfigError(
                f"topk={topk} exceeds a chunk={chunk} block's {self.chunk * self.chunk} coefficients; "
                "accepted: topk <= chunk * chunk"
            )
        self.sign = check_bool("sign", sign)
        self._bases: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    def basis(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """:func:`dct_basis`, cached per (n, dtype, device)."""
        key = (n, dtype, device)
        if key not in self._bases:
            self._bases[key] = dct_basis(n, dtype, device)
        return self._bases[key]

    def layout(self, tensor: Tensor) -> DemoContext:
        rows = tensor.shape[0] if tensor.dim() >= 2 else 1
        cols = math.prod(tensor.shape[1:]) if tensor.dim() >= 2 else tensor.numel()
        c1, c2 = chunk_of(rows, self.chunk), chunk_of(cols, self.chunk)
        return DemoContext(tensor.shape, tensor.dtype, rows, cols, c1, c2, min(self.topk, c1 * c2))

    def _scratch(self, like: Tensor, *apart: Tensor) -> Tensor:
        """A tensor shaped like ``like`` for a product: the workspace's one gradient-sized buffer
        unless it holds one of ``apart`` (then a fresh tensor). A fresh full-size tensor costs
        page faults that outweigh a product's arithmetic on a CPU; one buffer keeps demo's
        scratch to a gradient."""
        if like.numel():
            buffer = self.workspace.get("a", like.numel(), like.dtype, like.device).view(like.shape)
            if all(buffer.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in apart):
                return buffer
        return torch.empty_like(like)

    def dct(self, tensor: Tensor, ctx: DemoContext) -> Tensor:
        """Coefficients ``(blocks, c₁·c₂)``: block (by, bx) at row by·(cols/c₂) + bx, its
        coefficient (h, w) at column h·c₂ + w (the reference's layout). In a workspace buffer:
        valid until the next call."""
        dtype = compute_dtype(tensor.dtype)
        x = tensor.reshape(ctx.rows, ctx.cols // ctx.c2, ctx.c2).to(dtype)
        if ctx.c2 > 1:  # along the columns of each block: one GEMM
            x = torch.matmul(x, self.basis(ctx.c2, dtype, x.device).T, out=self._scratch(x, x))
        x = x.reshape(ctx.rows // ctx.c1, ctx.c1, ctx.cols)
        if ctx.c1 > 1:  # along the rows of each block
            x = torch.matmul(self.basis(ctx.c1, dtype, x.device), x, out=self._scratch(x, x))
        x = x.reshape(ctx.rows // ctx.c1, ctx.c1, ctx.cols // ctx.c2, ctx.c2).transpose(1, 2)
        return x.reshape(ctx.blocks, ctx.c1 * ctx.c2)

    def idct(self, coefficients: Tensor, ctx: DemoContext, out: Tensor | None = None) -> Tensor:
        """Inverse of :meth:`dct`, in the coefficients' dtype, shaped like the tensor: into
        ``out`` (of that dtype, contiguous) when given, else into a workspace buffer."""
        nby, nbx = ctx.rows // ctx.c1, ctx.cols // ctx.c2
        x = coefficients.reshape(nby, nbx, ctx.c1, ctx.c2).transpose(1, 2).reshape(nby, ctx.c1, ctx.cols)
        if ctx.c1 > 1:
            x = torch.matmul(self.basis(ctx.c1, x.dtype, x.device).T, x, out=self._scratch(x, x))
        x = x.reshape(ctx.rows, nbx, ctx.c2)
        target = out.view(x.shape) if out is not None else self._scratch(x, x)
        if ctx.c2 > 1:
            return torch.matmul(x, self.basis(ctx.c2, x.dtype, x.device), out=target).view(ctx.shape)
        return target.copy_(x).view(ctx.shape)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, DemoContext]:
        ctx = self.layout(tensor)
        coefficients = self.dct(tensor, ctx)
        indices = torch.empty(ctx.blocks, ctx.k, dtype=torch.int64, device=coefficients.device)
        width = coefficients.shape[1]

        def select(start: int, stop: int) -> None:  # |M| of a run of blocks at a time, in cache
            rows = coefficients[start // width : stop // width]
            magnitudes = self.workspace.get("magnitudes", rows.numel(), rows.dtype, rows.device).view(rows.shape)
            picked = torch.topk(torch.abs(rows, out=magnitudes), ctx.k, dim=1, sorted=False).indices
            indices[start // width : stop // width] = picked

        for_chunks(select, coefficients.numel(), coefficients.device, multiple=width)
        values = coefficients.gather(1, indices)
        return [values.reshape(-1).to(tensor.dtype), indices.reshape(-1).to(torch.int32)], ctx

    def coefficients(self, payloads: Sequence[Payload], ctx: DemoContext) -> Tensor:
        """Q: per coefficient, the mean of the values of the ranks that sent it (0 if none),
        added in rank order (each rank's indices are distinct: the same bits on every rank).
        In a workspace buffer: valid until the next call."""
        values = payloads[0][0]
        dtype = compute_dtype(ctx.dtype)
        size = ctx.blocks * ctx.c1 * ctx.c2
        total = self.workspace.get("a", size, dtype, values.device).view(ctx.blocks, ctx.c1 * ctx.c2).zero_()
        count = torch.zeros_like(total) if len(payloads) > 1 else None
        ones = torch.ones(ctx.blocks, ctx.k, dtype=dtype, device=values.device)
        for sent, where in payloads:
            index = where.reshape(ctx.blocks, ctx.k).long()
            total.scatter_add_(1, index, sent.reshape(ctx.blocks, ctx.k).to(dtype))
            if count is not None:
                count.scatter_add_(1, index, ones)
        return total if count is None else total.div_(count.clamp_(min=1))

    def _decoded_into(self, coefficients: Tensor, ctx: DemoContext, out: Tensor, sign: bool) -> Tensor:
        """IDCT(coefficients) (its sign with ``sign``) into ``out``: straight there when ``out``
        is contiguous in the transform's dtype, else through a workspace buffer."""
        direct = out.dtype == compute_dtype(ctx.dtype) and out.is_contiguous()
        decoded = self.idct(coefficients, ctx, out if direct else None)
        if sign:
            decoded.sign_()
        return out if direct else out.copy_(decoded.view(out.shape))

    def decompress_into(self, payload: Payload, ctx: DemoContext, out: Tensor) -> Tensor:
        """q_r: this payload's coefficients, inverse-transformed (no sign: what was sent)."""
        return self._decoded_into(self.coefficients([payload], ctx), ctx, out, sign=False)

    def decompress(self, payload: Payload, ctx: DemoContext) -> Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=payload[0].device)
        return self.decompress_into(payload, ctx, out)

    def decompress_aggregate_into(self, payloads: Sequence[Payload], ctx: DemoContext, out: Tensor) -> Tensor:
        """Step 5: sign(IDCT(Q)) (or IDCT(Q)) from every rank's payload."""
        return self._decoded_into(self.coefficients(payloads, ctx), ctx, out, sign=self.sign)

    def decompress_aggregate(self, payloads: Sequence[Payload], ctx: DemoContext) -> Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=payloads[0][0].device)
        return self.decompress_aggregate_into(payloads, ctx, out)

    def aggregate(self, tensors: Sequence[Tensor]) -> Tensor:
        """For already-decoded tensors: their mean (step 5 where every rank sent every
        coefficient), then the sign."""
        mean = torch.stack(list(tensors)).mean(dim=0, dtype=compute_dtype(tensors[0].dtype))
        return (mean.sign_() if self.sign else mean).to(tensors[0].dtype)
