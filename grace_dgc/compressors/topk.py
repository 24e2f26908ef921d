import math

import torch

from ..errors import check_range
from ..interfaces import Compressor
from ..registry import register_compressor
from ..workspace import PARALLEL_GRAIN, for_chunks


def sparse_payload(flat, indices):
    """Values at ``indices`` and the indices as int32: the sparse wire format."""
    return [flat.index_select(0, indices), indices.to(torch.int32)]


def scatter_dense(payload, shape, dtype):
    """Inverse of :func:`sparse_payload`: zeros with the values written at the indices."""
    values = payload[0]
    return scatter_into(torch.empty(shape, dtype=dtype, device=values.device), payload)


def scatter_into(out, payload):
    """:func:`scatter_dense` written into ``out``."""
    values, indices = payload
    flat = out.zero_().view(-1)
    flat[indices.long()] = values.to(out.dtype)
    return out


def scatter_sum(payloads, shape, dtype):
    """Σ of :func:`scatter_dense` over several ranks' payloads, into one dense tensor
    (values at an index sent by several ranks add up, in rank order)."""
    values = payloads[0][0]
    return scatter_sum_into(torch.empty(shape, dtype=dtype, device=values.device), payloads)


def scatter_sum_into(out, payloads):
    """:func:`scatter_sum` written into ``out``."""
    values = torch.cat([p[0] for p in payloads]).to(out.dtype)
    indices = torch.cat([p[1] for p in payloads]).long()
    out.zero_().view(-1).index_put_((indices,), values, accumulate=True)
    return out


def subtract_at_(tensor, payload):
    """``tensor -= scatter_dense(payload)`` in place, touching only the sent indices (each
    index is sent once, so a gather-subtract-scatter is exact)."""
    values, indices = payload
    flat, indices = tensor.view(-1), indices.long()
    flat[indices] = flat[indices] - values.to(tensor.dtype)
    return tensor


def index_mask(payload, shape):
    """Where a :func:`sparse_payload` put values (a sent zero included): the exact sent set."""
    mask = torch.zeros(torch.Size(shape).numel(), dtype=torch.bool, device=payload[1].device)
    mask[payload[1].long()] = True
    return mask.view(shape)


def flat_nonzero(mask):
    """``torch.nonzero(mask).view(-1)`` for a 1-D bool mask, in two levels: first the 8-byte
    words with a hit, then the hits inside them (several times faster on a CPU for the
    sparse masks of sparsifiers)."""
    if mask.numel() % 8 or mask.storage_offset() % 8:
        return torch.nonzero(mask).view(-1)
    words = torch.nonzero(mask.view(torch.int64)).view(-1)
    inside = torch.nonzero(mask.view(-1, 8).index_select(0, words))
    return words.index_select(0, inside[:, 0]).mul_(8).add_(inside[:, 1])


def at_least(flat, threshold, workspace, keep_nan=True):
    """``(indices, magnitudes)`` of the elements with ``|x| ≥ threshold``, ascending, found
    chunk by chunk on the chunk workers without a full-size temporary; NaNs count as large
    with ``keep_nan`` (as torch.topk ranks them), as small without. (An integer test on the
    fp32 bit patterns was used here before; torch 2.13's comparisons vectorise, and a plain
    compare measured 1.0-1.5× faster at every size.)"""
    threshold = float(threshold)
    if flat.numel() <= PARALLEL_GRAIN:  # one small chunk: the fewest ops win
        magnitude = flat.abs()
        mask = magnitude.lt(threshold).logical_not_() if keep_nan else magnitude.ge(threshold)
        hits = torch.nonzero(mask).view(-1)
        return hits, magnitude.index_select(0, hits)

    def scan(start, stop):
        magnitude = torch.abs(flat[start:stop], out=workspace.get("abs", stop - start, flat.dtype, flat.device))
        mask = workspace.get("mask", stop - start, torch.bool, flat.device)
        if keep_nan:
            mask = torch.lt(magnitude, threshold, out=mask).logical_not_()
        else:
            mask = torch.ge(magnitude, threshold, out=mask)
        hits = flat_nonzero(mask)
        magnitudes = magnitude.index_select(0, hits)
        return (hits.add_(start) if start else hits), magnitudes

    return _joined(for_chunks(scan, flat.numel(), flat.device, multiple=8), flat)


def _joined(scans, flat):
    """One ``(indices, magnitudes)`` from the chunks' ``(hits, magnitudes)``, in order."""
    if len(scans) <= 1:
        return scans[0] if scans else (flat.new_empty(0, dtype=torch.int64), flat.new_empty(0))
    return torch.cat([hits for hits, _ in scans]), torch.cat([magnitude for _, magnitude in scans])


def kth_smallest(values, j):
    """The j-th smallest of the 1-D ``values`` (NaN counts as the largest), as a 0-d tensor.
    On CUDA ``kthvalue`` is a slow sort-based path (1.4 ms over 255K candidates on an H100),
    while j is small here (the candidates' surplus over k): the largest of the j smallest by
    ``topk`` (a radix select) is the same element."""
    if values.is_cuda:
        return torch.topk(values, j, largest=False, sorted=False).values.max()
    return torch.kthvalue(values, j).values


def exact_top_k(flat, k, workspace):
    """Ascending int64 indices of the ``k`` largest ``|flat_i|``: exactly the set
    ``torch.topk(flat.abs(), k)`` selects, ties at the k-th magnitude going to the lowest
    indices. One pass over ``flat`` instead of a full selection:

    1. a strided sample of m ≈ n/64 elements (stride odd); τ = its j-th largest magnitude,
       j = ⌈q·k + 4·√(q·k) + 2⌉ with q = m/n: the sample's expected share of the top k plus
       four standard deviations, so τ ≤ the k-th magnitude κ with high probability;
    2. C = { i : |flat_i| ≥ τ } in one chunked pass. If |C| ≥ k, C holds the whole top k
       (anything outside C is below τ ≤ κ): the result is exact whatever the sample was.
       Otherwise j is doubled and step 2 repeats (C = everything once j exceeds m);
    3. κ = the k-th largest of |flat_C| (a selection over |C| ≈ k·(1 + 4/√(q·k)) values);
       sent = { |x| > κ } plus the lowest-indexed { |x| = κ } up to k elements.
    """
    n = flat.numel()
    stride = max(1, n // 65536) | 1
    if stride == 1:  # small: one selection; exact unless elements tie at the k-th magnitude
        magnitude = flat.abs()
        values, indices = torch.topk(magnitude, k)
        kth = values[-1:]
        if not torch.isnan(kth).item() and int(magnitude.lt(kth).logical_not_().sum()) == k:
            return indices.sort().values
    sample = flat[::stride].abs()
    q = sample.numel() / n
    rank = math.ceil(q * k + 4 * math.sqrt(q * k) + 2)
    while True:
        if stride == 1 or rank >= sample.numel():
            candidates, magnitude = torch.arange(n, device=flat.device), flat.abs()
            break
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        candidates, magnitude = at_least(flat, threshold, workspace)
        if candidates.numel() >= k:
            break
        rank *= 2
    if candidates.numel() == k:
        return candidates
    kth = kth_smallest(magnitude, candidates.numel() - k + 1)
    if torch.isnan(kth):  # more NaNs than k: the lowest-indexed NaNs
        chosen, tied = torch.zeros_like(magnitude, dtype=torch.bool), torch.isnan(magnitude)
    else:
        chosen, tied = ~(magnitude <= kth), magnitude == kth  # larger (NaN included), tied
    missing = k - int(chosen.sum())
    chosen[torch.nonzero(tied).view(-1)[:missing]] = True
    return candidates[chosen]


class SparseCompressor(Compressor):
    """Base of the sparsifiers whose payload is :func:`sparse_payload` and ctx
    ``(shape, dtype)``: decompression, the one-scatter aggregate, the in-place residual and
    the exact sent set, shared. Their payloads can be summed index by index
    (``sparse_allreduce``), not chunk by chunk (the selection spans the whole tensor)."""

    sparse = True
    chunkable = False

    def decompress(self, payload, ctx):
        return scatter_dense(payload, *ctx[:2])

    def decompress_into(self, payload, ctx, out):
        return scatter_into(out, payload)

    def decompress_aggregate(self, payloads, ctx):
        return scatter_sum(payloads, *ctx[:2])

    def decompress_aggregate_into(self, payloads, ctx, out):
        return scatter_sum_into(out, payloads)

    def subtract_sent_(self, tensor, payload, ctx):
        return subtract_at_(tensor, payload)

    def sent_mask(self, payload, ctx):
        return index_mask(payload, ctx[0])

    def mask_sent_(self, tensor, payload, ctx):
        tensor.view(-1).index_fill_(0, payload[1].long(), 0)
        return tensor


@register_compressor("topk")
class TopKCompressor(SparseCompressor):
    """Exact top-k by magnitude (Aji & Heafield 2017; Stich et al. 2018).

        k = max(1, floor(compress_ratio · n)),   S = argtop_k |g_i|,
        payload = (g_S, S)  — k values in the tensor's dtype + k int32 indices (ascending).

    S is exact (:func:`exact_top_k`: a sampled pre-filter, then a selection among the few
    candidates); of elements tied at the k-th magnitude, the lowest indices are sent.
    """

    SETTINGS = ("compress_ratio",)

    def __init__(self, compress_ratio=0.01):
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        k = max(1, int(flat.numel() * self.compress_ratio)) if flat.numel() else 0
        indices = exact_top_k(flat, k, self.workspace) if k else flat.new_empty(0, dtype=torch.int64)
        return sparse_payload(flat, indices), (tensor.shape, tensor.dtype)
