"""The sparse wire format and what the sparsifiers share (topk, threshold, dgc; plugins
with ``sparse = True``).

A sparse payload is ``[values, indices]``: the selected values in the tensor's dtype (or
fp16) and their int32 positions in the flattened tensor, each at most once. Decompression
scatters the values into zeros, so payloads of several ranks add up index by index
(``sparse_allreduce``). The ctx is a :class:`SparseContext`; a tensor sent whole (DGC's
small tensors) has payload ``[all values]`` and ``whole=True``, which is how a
communicator tells the two apart without reading the payload's layout.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import kernels
from ..interfaces import Compressor, Payload
from ..workspace import PARALLEL_GRAIN, Workspace, compare, for_chunks
from .packed import Shaped


class SparseContext(NamedTuple):
    """ctx of a sparse payload: the tensor's shape and dtype, and whether it went whole."""

    shape: torch.Size
    dtype: torch.dtype
    whole: bool = False


# what SparseCompressor's methods accept: a plugin sparsifier may still hand a plain
# (shape, dtype) tuple, which reads as sent sparse
SparseCtx = SparseContext | Shaped


def sent_whole(ctx: Any) -> bool:
    """Was this tensor sent whole (payload ``[values]``) rather than as ``[values, indices]``?"""
    return isinstance(ctx, SparseContext) and ctx.whole


def sparse_payload(flat: Tensor, indices: Tensor) -> Payload:
    """Values at ``indices`` and the indices as int32: the sparse wire format."""
    return [flat.index_select(0, indices), indices.to(torch.int32)]


def scatter_dense(payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`sparse_payload`: zeros with the values written at the indices."""
    values = payload[0]
    return scatter_into(torch.empty(shape, dtype=dtype, device=values.device), payload)


def scatter_into(out: Tensor, payload: Payload) -> Tensor:
    """:func:`scatter_dense` written into ``out`` (distinct indices). The zero-fill and the
    scatter run on the chunk workers (:func:`~grace_dgc.workspace.for_chunks`): two
    whole-tensor ops would be two fork-joins of torch's threads, which a competing process
    stretches by a scheduler tick each."""
    values, indices = payload
    flat, values, indices = out.view(-1), values.to(out.dtype), indices.long()
    for_chunks(lambda start, stop: flat[start:stop].zero_(), flat.numel(), out.device)
    for_chunks(
        lambda start, stop: flat.index_copy_(0, indices[start:stop], values[start:stop]), indices.numel(), out.device
    )
    return out


def scatter_sum(payloads: Sequence[Payload], shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Σ of :func:`scatter_dense` over several ranks' payloads, into one dense tensor
    (values at an index sent by several ranks add up, in rank order)."""
    values = payloads[0][0]
    return scatter_sum_into(torch.empty(shape, dtype=dtype, device=values.device), payloads)


def scatter_sum_into(out: Tensor, payloads: Sequence[Payload]) -> Tensor:
    """:func:`scatter_sum` written into ``out``."""
    values = torch.cat([p[0] for p in payloads]).to(out.dtype)
    indices = torch.cat([p[1] for p in payloads]).long()
    out.zero_().view(-1).index_put_((indices,), values, accumulate=True)
    return out


def subtract_at_(tensor: Tensor, payload: Payload) -> Tensor:
    """``tensor -= scatter_dense(payload)`` in place, touching only the sent indices (each
    index is sent once, so a gather-subtract-scatter is exact)."""
    values, indices = payload
    flat, indices = tensor.view(-1), indices.long()
    flat[indices] = flat[indices] - values.to(tensor.dtype)
    return tensor


def index_mask(payload: Payload, shape: Sequence[int]) -> Tensor:
    """Where a :func:`sparse_payload` put values (a sent zero included): the exact sent set."""
    mask = torch.zeros(torch.Size(shape).numel(), dtype=torch.bool, device=payload[1].device)
    mask[payload[1].long()] = True
    return mask.view(shape)


def flat_nonzero(mask: Tensor) -> Tensor:
    """``torch.nonzero(mask).view(-1)`` for a 1-D bool mask, in two levels: first the 8-byte
    words with a hit, then the hits inside them (several times faster on a CPU for the
    sparse masks of sparsifiers)."""
    if mask.numel() % 8 or mask.storage_offset() % 8:
        return torch.nonzero(mask).view(-1)
    words = torch.nonzero(mask.view(torch.int64)).view(-1)
    inside = torch.nonzero(mask.view(-1, 8).index_select(0, words))
    return words.index_select(0, inside[:, 0]).mul_(8).add_(inside[:, 1])


def at_least(
    flat: Tensor, threshold: float | Tensor, workspace: Workspace, keep_nan: bool = True
) -> tuple[Tensor, Tensor]:
    """``(indices, magnitudes)`` of the elements with ``|x| ≥ threshold``, ascending, found
    chunk by chunk on the chunk workers without a full-size temporary; NaNs count as large
    with ``keep_nan`` (as torch.topk ranks them), as small without. (An integer test on the
    fp32 bit patterns was used here before; torch 2.13's comparisons vectorise, and a plain
    compare measured 1.0-1.5× faster at every size.)"""
    threshold = float(threshold)
    launch = lambda: kernels.at_least(flat, threshold, keep_nan)  # noqa: E731
    fused = kernels.attempt(launch, flat.device, flat.dtype) if flat.numel() else None
    if fused is not None:  # a GPU: one fused count, then one fused write
        return fused
    if flat.numel() <= PARALLEL_GRAIN:  # one small chunk: the fewest ops win
        magnitude = flat.abs()
        mask = magnitude.lt(threshold).logical_not_() if keep_nan else magnitude.ge(threshold)
        hits = torch.nonzero(mask).view(-1)
        return hits, magnitude.index_select(0, hits)

    def scan(start: int, stop: int) -> tuple[Tensor, Tensor]:
        magnitude = torch.abs(flat[start:stop], out=workspace.get("abs", stop - start, flat.dtype, flat.device))
        mask = workspace.get("mask", stop - start, torch.bool, flat.device)
        if keep_nan:  # |x| ≥ τ or NaN
            mask = compare("lt", magnitude, threshold, mask).logical_not_()
        else:
            mask = compare("ge", magnitude, threshold, mask)
        hits = flat_nonzero(mask)
        magnitudes = magnitude.index_select(0, hits)
        return (hits.add_(start) if start else hits), magnitudes

    return _joined(for_chunks(scan, flat.numel(), flat.device, multiple=8), flat)


def _joined(scans: list[tuple[Tensor, Tensor]], flat: Tensor) -> tuple[Tensor, Tensor]:
    """One ``(indices, magnitudes)`` from the chunks' ``(hits, magnitudes)``, in order."""
    if len(scans) <= 1:
        return scans[0] if scans else (flat.new_empty(0, dtype=torch.int64), flat.new_empty(0))
    return torch.cat([hits for hits, _ in scans]), torch.cat([magnitude for _, magnitude in scans])


class SparseCompressor(Compressor):
    """Base of the sparsifiers whose payload is :func:`sparse_payload` and ctx a
    :class:`SparseContext` (or a plain ``(shape, dtype)`` tuple for one sent sparse):
    decompression, the one-scatter aggregate, the in-place residual and the exact sent set,
    shared, for tensors sent sparse and sent whole alike. Their
    payloads can be summed index by index (``sparse_allreduce``), not chunk by chunk (the
    selection spans the whole tensor)."""

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    sparse = True

    def decompress(self, payload: Payload, ctx: SparseCtx) -> Tensor:
        if sent_whole(ctx):
            return payload[0].to(ctx[1]).view(ctx[0])
        return scatter_dense(payload, ctx[0], ctx[1])

    def decompress_into(self, payload: Payload, ctx: SparseCtx, out: Tensor) -> Tensor:
        return out.copy_(payload[0].view(out.shape)) if sent_whole(ctx) else scatter_into(out, payload)

    def decompress_aggregate(self, payloads: Sequence[Payload], ctx: SparseCtx) -> Tensor:
        if sent_whole(ctx):
            return self.aggregate([self.decompress(p, ctx) for p in payloads])
        return scatter_sum(payloads, ctx[0], ctx[1])

    def decompress_aggregate_into(self, payloads: Sequence[Payload], ctx: SparseCtx, out: Tensor) -> Tensor:
        if sent_whole(ctx):
            return out.copy_(self.decompress_aggregate(payloads, ctx))
        return scatter_sum_into(out, payloads)

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: SparseCtx) -> Tensor:
        return tensor.sub_(payload[0].view(tensor.shape)) if sent_whole(ctx) else subtract_at_(tensor, payload)

    def sent_mask(self, payload: Payload, ctx: SparseCtx) -> Tensor:
        if sent_whole(ctx):
            return torch.ones(ctx[0], dtype=torch.bool, device=payload[0].device)
        return index_mask(payload, ctx[0])

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: SparseCtx) -> Tensor:
        if sent_whole(ctx):
            return tensor.zero_()
        tensor.view(-1).index_fill_(0, payload[1].long(), 0)
        return tensor
