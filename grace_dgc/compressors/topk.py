import torch

from ..errors import check_range
from ..interfaces import Compressor
from ..registry import register_compressor


def sparse_payload(flat, indices):
    """Values at ``indices`` and the indices as int32: the sparse wire format."""
    return [flat[indices], indices.to(torch.int32)]


def scatter_dense(payload, shape, dtype):
    """Inverse of :func:`sparse_payload`: zeros with the values written at the indices."""
    values, indices = payload
    dense = torch.zeros(torch.Size(shape).numel(), dtype=dtype, device=values.device)
    dense[indices.long()] = values.to(dtype)
    return dense.view(shape)


def scatter_sum(payloads, shape, dtype):
    """Σ of :func:`scatter_dense` over several ranks' payloads, into one dense tensor
    (values at an index sent by several ranks add up, in rank order)."""
    values = torch.cat([p[0] for p in payloads]).to(dtype)
    indices = torch.cat([p[1] for p in payloads]).long()
    dense = torch.zeros(torch.Size(shape).numel(), dtype=dtype, device=values.device)
    return dense.index_put_((indices,), values, accumulate=True).view(shape)


def index_mask(payload, shape):
    """Where a :func:`sparse_payload` put values (a sent zero included): the exact sent set."""
    mask = torch.zeros(torch.Size(shape).numel(), dtype=torch.bool, device=payload[1].device)
    mask[payload[1].long()] = True
    return mask.view(shape)


@register_compressor("topk")
class TopKCompressor(Compressor):
    """Exact top-k by magnitude (Aji & Heafield 2017; Stich et al. 2018).

        k = max(1, floor(compress_ratio · n)),   S = argtop_k |g_i|,
        payload = (g_S, S)  — k values in the tensor's dtype + k int32 indices.
    """

    def __init__(self, compress_ratio=0.01):
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        k = max(1, int(flat.numel() * self.compress_ratio)) if flat.numel() else 0
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return sparse_payload(flat, indices), (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return scatter_dense(payload, *ctx)

    def decompress_aggregate(self, payloads, ctx):
        return scatter_sum(payloads, *ctx)

    def sent_mask(self, payload, ctx):
        return index_mask(payload, ctx[0])
