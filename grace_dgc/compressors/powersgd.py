import zlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..errors import check_bool, check_range
from ..interfaces import Compressor, Payload
from ..registry import register_compressor


def orthogonalize(matrix: Tensor, epsilon: float = 0.0) -> Tensor:
    """``matrix`` (n × r) with orthonormal columns, computed as PyTorch's ``powerSGD_hook`` does.

    Gram–Schmidt for r ≤ 2 (and half precision), ``col / (‖col‖ + epsilon)``; Householder QR
    otherwise. Unlike the hook, an all-zero column stays zero when ``epsilon`` is 0 instead of
    becoming NaN (a parameter that got no gradient is exchanged as zeros).
    """
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(matrix).Q
    out = matrix.clone()
    for i in range(rank):  # r columns (r is tiny); each step is vectorised over the n rows
        col = out[:, i : i + 1]
        norm = col.norm()
        col /= (norm + epsilon) if epsilon else torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < rank:  # remove the column's direction from the columns after it
            rest = out[:, i + 1 :]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    return out


class Dense(NamedTuple):
    """ctx of a tensor sent whole, in one round."""

    shape: torch.Size


class Factors(NamedTuple):
    """ctx of a low-rank tensor: ``matrix`` (local M) in round 1, then ``p`` (P̂, equal on all ranks)."""

    name: str
    shape: torch.Size
    matrix: torch.Tensor | None
    p: torch.Tensor | None


@register_compressor("powersgd")
class PowerSGDCompressor(Compressor):
    """PowerSGD (Vogels, Karimireddy & Jaggi 2019): rank-r factors from one warm-started power step.

    Each tensor is viewed as M ∈ R^{n×m}, n = shape[0], m = ∏ shape[1:]; r = min(n, m, compress_rank):

        Q ← orth(Q_prev)            warm start: last step's aggregated Q (first step: N(0,1) from seed)
        P = M Q                     round 1 payload, summed over ranks:  P_sum = Σ_w P_w
        P̂ = orth(P_sum)             identical on every rank
        Q_w = Mᵀ P̂                  round 2 payload, summed:  Q_sum = Σ_w Q_w  (kept as next Q_prev)
        decompress = P̂ Q_sumᵀ       (Grace divides by the world size: P̂ Q_sumᵀ / W)

    With the residual memory (``powersgd``) the local error is e_w = M_w − P̂ Q_wᵀ. PyTorch's hook
    keeps e_w = M_w − P̂ Q_sumᵀ/W instead; the two differ per rank but have the same sum over
    ranks, and since every exchanged quantity is linear in Σ_w M_w, the aggregates are equal.

    Dense (one round, payload [M]): 0-d and 1-D tensors (biases, norm weights) and matrices whose
    factors do not save enough, i.e. unless (n + m)·r·min_compression_rate < n·m — the rule and
    default (2) of the hook's ``min_compression_rate``. On the wire: (n + m)·r values per matrix.

    ``orth`` is :func:`orthogonalize` (scale-free when ``orthogonalization_epsilon`` is 0; with
    ε > 0 the warm start differs from the hook's by O(ε), as the hook keeps Q_sum/W). The initial Q
    of tensor ``name`` comes from a ``torch.Generator`` seeded by seed ⊕ crc32(name) ⊕ draw count,
    so all ranks draw the same Q without touching the global RNG; ``warm_start=False`` draws a fresh Q every step.
    """

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    summable = True
    rounds = 2

    SETTINGS = ("compress_rank", "min_compression_rate", "warm_start", "orthogonalization_epsilon", "seed")
    STATE = ("q", "draws")
    REPLICATED = STATE  # Q is averaged, so alike on every rank; a rank with another would mix bases

    def __init__(
        self,
        compress_rank: int = 1,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.compress_rank = check_range("compress_rank", compress_rank, 1, kind=int)
        self.min_compression_rate = check_range("min_compression_rate", min_compression_rate, 0)
        self.warm_start = check_bool("warm_start", warm_start)
        self.orthogonalization_epsilon = check_range("orthogonalization_epsilon", orthogonalization_epsilon, 0)
        self.seed = check_range("seed", seed, 0, kind=int)
        self.q: dict[str, Tensor] = {}  # name -> Q_sum of the last step (the warm start), shape m × r
        self.draws: dict[str, int] = {}  # name -> how many initial Qs were drawn for it

    def low_rank(self, shape: torch.Size) -> int:
        """r for a tensor of ``shape``, or 0 when it goes dense."""
        if len(shape) < 2:
            return 0
        n, m = shape[0], torch.Size(shape[1:]).numel()
        rank = min(n, m, self.compress_rank)
        return rank if (n + m) * rank * self.min_compression_rate < n * m else 0

    def state_numels(self, key: str, shape: torch.Size) -> tuple[int, ...] | None:
        """Q of a low-rank tensor is m × r (none is kept for a tensor sent dense)."""
        return (torch.Size(shape[1:]).numel() * self.low_rank(shape),) if key == "q" else None

    def initial_q(self, name: str, m: int, rank: int, dtype: torch.dtype) -> Tensor:
        draw = self.draws.get(name, 0)
        self.draws[name] = draw + 1
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + draw) % 2**63
        )
        # drawn on the CPU, so CPU and CUDA runs start from the same Q
        return torch.randn(m, rank, generator=generator, dtype=dtype)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Dense | Factors]:
        rank = self.low_rank(tensor.shape)
        if not rank:
            return [tensor], Dense(tensor.shape)
        matrix = tensor.reshape(tensor.shape[0], -1)
        q = self.q.get(name) if self.warm_start else None
        if q is None or q.shape != (matrix.shape[1], rank):
            q = self.initial_q(name, matrix.shape[1], rank, tensor.dtype)
        q = orthogonalize(q.to(device=tensor.device, dtype=tensor.dtype), self.orthogonalization_epsilon)
        return [matrix @ q], Factors(name, tensor.shape, matrix, None)

    def next_round(self, summed_payload: Payload, ctx: Any) -> tuple[Payload, Factors] | None:
        if isinstance(ctx, Dense):  # sent whole: done after one round
            return None
        if ctx.p is None:  # got Σ P: send this rank's Q = Mᵀ P̂
            p_hat = orthogonalize(summed_payload[0], self.orthogonalization_epsilon)
            return [ctx.matrix.t() @ p_hat], Factors(ctx.name, ctx.shape, None, p_hat)
        if self.warm_start:  # got Σ Q: next step starts from it
            self.q[ctx.name] = summed_payload[0].clone()
        return None

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        if isinstance(ctx, Dense):
            return payload[0].reshape(ctx.shape)
        return (ctx.p @ payload[0].t()).reshape(ctx.shape)

    def decompress_into(self, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        if isinstance(ctx, Dense) or out.dtype != ctx.p.dtype or not out.is_contiguous():
            return super().decompress_into(payload, ctx, out)
        torch.mm(ctx.p, payload[0].t(), out=out.view(ctx.shape[0], -1))
        return out
