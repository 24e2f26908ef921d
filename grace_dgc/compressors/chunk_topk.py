import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import kernels, wire
from ..errors import GraceConfigError, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import for_chunks
from .sparse import SparseCompressor, SparseContext, SparseCtx, sent_whole

MAX_CHUNK = 2**16  # local indices of at most 16 bits


def group_size(chunk: int, k: int) -> int:
    """The group of :meth:`ChunkTopKCompressor._top_k`'s first round: the power of two s
    nearest √(C/k) that divides C (the two rounds then see C/s + k·s elements, least near
    s = √(C/k)), or 1 (one round) where the two would see more than half the chunk."""
    s = 1 << max(0, round(math.log2(math.sqrt(chunk / k))))
    while s > 1 and chunk % s:
        s //= 2
    return s if s > 1 and chunk // s >= k and chunk // s + k * s <= chunk // 2 else 1


@register_compressor("chunk_topk", aliases=("chunked_topk",))
class ChunkTopKCompressor(SparseCompressor):
    """Top-k within each chunk of ``chunk`` consecutive elements (SparseLoCo, Sarfi et al.
    2025, arXiv 2508.15706, after DeMo's chunking; the chunk-local index codes of both).

    The flattened tensor is cut into chunks of C = ``chunk`` elements; each keeps its k
    largest magnitudes, and a last partial chunk of r < C elements keeps ⌈k·r/C⌉ (the same
    density, at least one):

        S = ⋃_c { cC + j : j ∈ argtop_k |g_{cC : (c+1)C}| },   |S| = ⌊n/C⌋·k + ⌈k·(n mod C)/C⌉

    Every chunk sends the same count, so the position of an entry in the payload says its
    chunk, and an index travels as its offset inside the chunk in b = ⌈log2 C⌉ bits (12 for
    C = 4096) instead of a 32-bit position: ``[values, offsets packed b bits each]``
    (wire.pack_bits), both ascending. A fixed count on every rank, so a chain may quantize
    the values (``chunk_topk>statq`` is SparseLoCo's compressor).

    Deviation: the chunks are runs of the flattened tensor, where SparseLoCo's code tiles a
    2-D weight in 64×64 blocks; both keep k of every C entries. The offsets are chunk-local,
    so ``sparse_allreduce`` (which sums global positions) does not carry this compressor;
    allgather and broadcast do.

    Plain reference: ``tests/core/test_chain.py::reference_chunk_topk`` (a Python loop over the
    chunks with ``sorted(range(C), key=|g|)``) equal index for index.
    """

    fixed_count = True
    chunk_local = True  # the offsets are chunk-local: sparse_allreduce refuses it

    SETTINGS = ("chunk", "k")

    def __init__(self, chunk: int = 4096, k: int = 64) -> None:
        self.chunk = check_range("chunk", chunk, 1, MAX_CHUNK, kind=int)
        self.k = check_range("k", k, 1, kind=int)
        if self.k > self.chunk:
            raise GraceConfigError(f"k={k} is more than a chunk holds (chunk={chunk}); accepted: 1 ≤ k ≤ chunk")
        self.offset_bits = max(1, (self.chunk - 1).bit_length())
        self.group = group_size(self.chunk, self.k)

    def counts(self, n: int) -> tuple[int, int]:
        """(whole chunks, what the last partial chunk keeps) for a tensor of ``n`` elements."""
        whole, rest = divmod(n, self.chunk)
        return whole, math.ceil(self.k * rest / self.chunk)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, SparseContext]:
        flat = tensor.reshape(-1)
        whole, tail_k = self.counts(flat.numel())
        cut, kept = whole * self.chunk, whole * self.k
        local = torch.empty(kept + tail_k, dtype=torch.int64, device=flat.device)
        values = flat.new_empty(kept + tail_k)
        if whole:
            launch = lambda: kernels.chunk_top_k(flat[:cut], self.chunk, self.k, local[:kept], values[:kept])  # noqa: E731
            fused = self.chunk <= kernels.CHUNK_TOP_LARGEST and kernels.attempt(
                launch, flat.device, flat.dtype, kernel="chunk_top_k"
            ) is not None  # fmt: skip
            if not fused:
                self._whole_chunks(flat[:cut].view(whole, self.chunk), local[:kept], values[:kept])
        if tail_k:
            tail = flat[cut:]
            local[kept:] = torch.topk(tail.abs(), tail_k, sorted=False).indices.sort().values
            torch.index_select(tail, 0, local[kept:], out=values[kept:])
        return [values, wire.pack_bits(local, self.offset_bits)], SparseContext(tensor.shape, tensor.dtype)

    def _whole_chunks(self, blocks: Tensor, offsets: Tensor, values: Tensor) -> None:
        """Into ``offsets`` and ``values`` (chunks·k each): argtop_k |row| of each row of
        ``blocks`` (chunks × C), ascending, and the elements there; a run of rows at a time in
        cache (|x| in a workspace buffer) on the CPU's workers (:func:`~grace_dgc.workspace.for_chunks`)."""
        c, k = self.chunk, self.k
        flat = blocks.reshape(-1)

        def select(start: int, stop: int) -> None:
            part = flat[start:stop].view(-1, c)
            magnitudes = self.workspace.get("abs", stop - start, part.dtype, part.device).view(-1, c)
            picked = self._top_k(torch.abs(part, out=magnitudes))
            rows = slice(start // c * k, stop // c * k)
            offsets[rows] = picked.view(-1)
            torch.gather(part, 1, picked, out=values[rows].view(-1, k))

        for_chunks(select, flat.numel(), blocks.device, multiple=c)

    def _top_k(self, magnitudes: Tensor) -> Tensor:
        """argtop_k of each row of ``magnitudes`` (rows × C, ≥ 0), ascending.

        In two rounds where the chunk is long against k: cut each row into C/s groups of s
        elements (group j: the offsets j, j + C/s, j + 2C/s, …) and keep the k groups with the
        largest peaks, then take the top k of their k·s members. Exact, not a sketch: an
        element of the top k lies in a group whose peak is at least its own, and fewer than k
        groups can peak above that (each would hold a larger element), so its group is among
        the k kept. For C = 4096, k = 64 (s = 8) the two selections see 512 + 512 elements of
        a chunk instead of 4096, and the peaks are s − 1 elementwise maxima of rows."""
        rows, c = magnitudes.shape
        s, k = self.group, self.k
        if s == 1:
            return torch.topk(magnitudes, k, dim=1, sorted=False).indices.sort(dim=1).values
        groups = magnitudes.view(rows, s, c // s)
        peaks = groups
        while peaks.shape[1] > 1:  # a tree of elementwise maxima over the s members (s is a power of two)
            half = peaks.shape[1] // 2
            peaks = torch.maximum(peaks[:, :half], peaks[:, half:])
        kept = torch.topk(peaks.view(rows, -1), k, dim=1, sorted=False).indices  # (rows, k) group numbers
        members = groups.gather(2, kept.unsqueeze(1).expand(rows, s, k)).view(rows, s * k)
        picked = torch.topk(members, k, dim=1, sorted=False).indices  # member i·k + j: row i of kept group j
        offsets = kept.gather(1, picked.remainder(k)).add_(picked.div(k, rounding_mode="floor").mul_(c // s))
        return offsets.sort(dim=1).values

    def _positions(self, local: Tensor) -> Tensor:
        """Global positions of the chunk-local offsets (the i-th entry is in chunk ⌊i/k⌋)."""
        chunk_of = torch.arange(local.numel(), device=local.device).div_(self.k, rounding_mode="floor")
        return chunk_of.mul_(self.chunk).add_(local)

    def _global(self, payload: Payload, ctx: SparseCtx) -> Payload:
        """The payload in the common sparse format: values and int64 positions."""
        if sent_whole(ctx):
            return payload
        values, packed = payload
        local = wire.unpack_bits(packed, self.offset_bits, values.numel()).long()
        return [values, self._positions(local)]

    def decompress(self, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().decompress(self._global(payload, ctx), ctx)

    def decompress_into(self, payload: Payload, ctx: SparseCtx, out: Tensor) -> Tensor:
        return super().decompress_into(self._global(payload, ctx), ctx, out)

    def decompress_aggregate(self, payloads: Sequence[Payload], ctx: SparseCtx) -> Tensor:
        return super().decompress_aggregate([self._global(p, ctx) for p in payloads], ctx)

    def decompress_aggregate_into(self, payloads: Sequence[Payload], ctx: SparseCtx, out: Tensor) -> Tensor:
        return super().decompress_aggregate_into([self._global(p, ctx) for p in payloads], ctx, out)

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().subtract_sent_(tensor, self._global(payload, ctx), ctx)

    def sent_mask(self, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().sent_mask(self._global(payload, ctx), ctx)

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().mask_sent_(tensor, self._global(payload, ctx), ctx)
