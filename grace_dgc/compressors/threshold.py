import torch

from ..errors import check_range
from ..interfaces import Compressor
from ..registry import register_compressor
from .topk import index_mask, scatter_dense, scatter_sum, sparse_payload


@register_compressor("threshold")
class ThresholdCompressor(Compressor):
    """Gradient dropping with one absolute threshold (Aji & Heafield 2017):

        S = { i : |g_i| ≥ τ },   payload = (g_S, S)  — a variable number of elements.

    Ranks send different sizes, so it needs allgather or broadcast.
    """

    def __init__(self, threshold=0.01):
        self.threshold = check_range("threshold", threshold, 0)

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        indices = torch.nonzero(flat.abs() >= self.threshold).reshape(-1)
        return sparse_payload(flat, indices), (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return scatter_dense(payload, *ctx)

    def decompress_aggregate(self, payloads, ctx):
        return scatter_sum(payloads, *ctx)

    def sent_mask(self, payload, ctx):
        return index_mask(payload, ctx[0])
