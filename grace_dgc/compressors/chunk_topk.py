import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import wire
from ..errors import GraceConfigError, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from .sparse import SparseCompressor, SparseContext, SparseCtx, sent_whole

MAX_CHUNK = 2**16  # local indices of at most 16 bits


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

    def counts(self, n: int) -> tuple[int, int]:
        """(whole chunks, what the last partial chunk keeps) for a tensor of ``n`` elements."""
        whole, rest = divmod(n, self.chunk)
        return whole, math.ceil(self.k * rest / self.chunk)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, SparseContext]:
        flat = tensor.reshape(-1)
        whole, tail_k = self.counts(flat.numel())
        cut = whole * self.chunk
        offsets = []
        if whole:
            blocks = flat[:cut].view(whole, self.chunk).abs()
            offsets.append(torch.topk(blocks, self.k, dim=1, sorted=False).indices.sort(dim=1).values.reshape(-1))
        if tail_k:
            tail = flat[cut:].abs()
            offsets.append(torch.topk(tail, tail_k, sorted=False).indices.sort().values)
        local = torch.cat(offsets) if offsets else flat.new_empty(0, dtype=torch.int64)
        values = flat.index_select(0, self._positions(local))
        return [values, wire.pack_bits(local, self.offset_bits)], SparseContext(tensor.shape, tensor.dtype)

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
