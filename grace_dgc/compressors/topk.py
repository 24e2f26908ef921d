import math

import torch
from torch import Tensor

from .. import kernels
from ..errors import check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import Workspace
from .sparse import SparseCompressor, SparseContext, at_least, sparse_payload

__all__ = ["TopKCompressor", "at_least", "exact_top_k", "kth_smallest", "sparse_payload"]


def kth_smallest(values: Tensor, j: int) -> Tensor:
    """The j-th smallest of the 1-D ``values`` (NaN counts as the largest), as a 0-d tensor.
    On CUDA ``kthvalue`` is a slow sort-based path (1.4 ms over 255K candidates on an H100),
    while j is small here (the candidates' surplus over k): the largest of the j smallest by
    ``topk`` (a radix select) is the same element."""
    if values.is_cuda:
        return torch.topk(values, j, largest=False, sorted=False).values.max()
    return torch.kthvalue(values, j).values


def exact_top_k(flat: Tensor, k: int, workspace: Workspace) -> Tensor:
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

    Where the fused kernels run, :func:`grace_dgc.kernels.top_k_indices` selects the same set
    with no host sync (κ by a radix select on the device): the same indices.
    """
    launch = lambda: kernels.top_k_indices(flat, k)  # noqa: E731
    fused = kernels.attempt(launch, flat.device, flat.dtype, kernel="top_k")  # no host sync: a radix select
    if fused is not None:
        return fused
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


@register_compressor("topk")
class TopKCompressor(SparseCompressor):
    """Exact top-k by magnitude (Aji & Heafield 2017; Stich et al. 2018).

        k = max(1, floor(compress_ratio · n)),   S = argtop_k |g_i|,
        payload = (g_S, S)  — k values in the tensor's dtype + k int32 indices (ascending).

    S is exact (:func:`exact_top_k`: a sampled pre-filter, then a selection among the few
    candidates); of elements tied at the k-th magnitude, the lowest indices are sent.
    """

    fixed_count = True  # k = ⌊ratio·n⌋ on every rank: a chain may quantize the values (topk>qsgd)

    SETTINGS = ("compress_ratio",)

    def __init__(self, compress_ratio: float = 0.01) -> None:
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, SparseContext]:
        flat = tensor.reshape(-1)
        k = max(1, int(flat.numel() * self.compress_ratio)) if flat.numel() else 0
        indices = exact_top_k(flat, k, self.workspace) if k else flat.new_empty(0, dtype=torch.int64)
        return sparse_payload(flat, indices), SparseContext(tensor.shape, tensor.dtype)
