import math
import zlib

import torch
from torch import Tensor

from ..errors import check_range
from ..interfaces import Compressor, Payload
from ..registry import register_compressor
from .sparse import subtract_at_

# Above this kept ratio a permutation of n is cheaper than drawing k distinct indices.
PERMUTATION_RATIO = 0.25


def distinct_indices(n: int, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct indices drawn uniformly from ``range(n)`` (every k-subset equally
    likely), ascending, int64, without a permutation of n when k ≤ n/4:

    1. draw m ≥ k indices with replacement (m from the expected number of distinct values
       of m draws, n·(1 − e^(−m/n)), plus a margin); more are drawn if still < k distinct;
    2. U = the distinct values (ascending). Given |U| = u, U is a uniform u-subset (the
       draws are exchangeable), so a uniform k-subset of U is a uniform k-subset of
       range(n): drop u − k of its positions, themselves drawn this way (u − k ≪ k).

    Cost: O(k log k) instead of O(n). Above k = n/4, ``randperm(n)[:k]``, sorted.
    """
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if k > PERMUTATION_RATIO * n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    m = math.ceil(-n * math.log1p(-k / n) * 1.02) + 16
    draws = torch.randint(n, (m,), generator=generator)
    distinct = torch.unique(draws)
    while distinct.numel() < k:  # rare: the margin fell short
        draws = torch.cat([distinct, torch.randint(n, (k,), generator=generator)])
        distinct = torch.unique(draws)
    surplus = distinct.numel() - k
    if not surplus:
        return distinct
    keep = torch.ones(distinct.numel(), dtype=torch.bool)
    keep[distinct_indices(distinct.numel(), surplus, generator)] = False
    return distinct[keep]


@register_compressor("randomk")
class RandomKCompressor(Compressor):
    """Random-k sparsification with indices shared by all ranks (Stich et al. 2018):

        S_t = k distinct indices, uniform, drawn from seed ⊕ crc32(name) ⊕ t,   payload = g_{S_t}.

    Every rank draws the same S_t from its own ``torch.Generator`` (the global RNG is not
    touched; :func:`distinct_indices` says how), so only the k values travel and payloads
    are summable (allreduce).
    """

    summable = True

    SETTINGS = ("compress_ratio", "seed")
    STATE = ("steps",)

    def __init__(self, compress_ratio: float = 0.01, seed: int = 0) -> None:
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)
        self.seed = check_range("seed", seed, 0, kind=int)
        self.steps: dict[str, int] = {}  # name -> how many times that tensor was compressed

    def indices(self, name: str, numel: int, step: int) -> Tensor:
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + step) % 2**63
        )
        k = max(1, int(numel * self.compress_ratio)) if numel else 0
        return distinct_indices(numel, k, generator)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, tuple[Tensor, torch.Size]]:
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        flat = tensor.reshape(-1)
        indices = self.indices(name, flat.numel(), step).to(tensor.device)
        return [flat.index_select(0, indices)], (indices, tensor.shape)

    def decompress(self, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        return self.decompress_into(payload, ctx, payload[0].new_empty(ctx[1]))

    def decompress_into(self, payload: Payload, ctx: tuple[Tensor, torch.Size], out: Tensor) -> Tensor:
        indices, _ = ctx
        out.zero_().view(-1)[indices] = payload[0].to(out.dtype)
        return out

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        return subtract_at_(tensor, [payload[0], ctx[0]])

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        tensor.view(-1).index_fill_(0, ctx[0], 0)
        return tensor

    def sent_mask(self, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        indices, shape = ctx  # the shared index set, a sent zero included
        mask = torch.zeros(torch.Size(shape).numel(), dtype=torch.bool, device=payload[0].device)
        mask[indices] = True
        return mask.view(shape)
