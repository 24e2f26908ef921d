"""THC: summable quantization on one scale agreed by all ranks, carried by a plain allreduce."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from ..errors import GraceConfigError, check_bool, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from .stochastic import StochasticCompressor

if TYPE_CHECKING:
    from ..engines.base import Engine


def hadamard(x: Tensor) -> Tensor:
    """H·x/√d for a 1-D ``x`` of d = 2^m elements (H Sylvester's ±1 matrix, as
    ``scipy.linalg.hadamard``): m butterfly stages over (blocks, 2, h) views, a new tensor.
    Orthonormal and symmetric, so it is its own inverse."""
    d = x.numel()
    if d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two length, got {d}")
    a, b, h = x.clone(), torch.empty_like(x), 1
    while h < d:
        pairs, into = a.view(-1, 2, h), b.view(-1, 2, h)
        torch.add(pairs[:, 0], pairs[:, 1], out=into[:, 0])
        torch.sub(pairs[:, 0], pairs[:, 1], out=into[:, 1])
        a, b, h = b, a, 2 * h
    return a.mul_(d**-0.5)


def rotation_signs(seed: int, name: str, step: int, d: int, device: torch.device | str) -> Tensor:
    """The ±1 diagonal D of the ``step``-th rotation of tensor ``name`` (float32): drawn from
    blake2b(seed, name, step), without the rank, so every rank rotates alike."""
    key = f"thc-rotation\0{seed}\0{name}\0{step}".encode()
    derived = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    generator = torch.Generator(device=device).manual_seed(derived)
    return torch.randint(0, 2, (d,), generator=generator, device=device, dtype=torch.float32).mul_(2).sub_(1)


def _largest(x: Tensor) -> Tensor:
    return x.abs().amax() if x.numel() else x.new_zeros(())  # amax propagates NaN


class THCContext(NamedTuple):
    """Equal on every rank: the gradient's look, the agreed scale M (0-d fp32) and D (or None)."""

    shape: torch.Size
    dtype: torch.dtype
    scale: Tensor
    signs: Tensor | None


@register_compressor("thc")
class THCCompressor(StochasticCompressor):
    """THC (Li et al., NSDI 2024), plain form: rotate, agree on one scale, sum integer codes.

    For tensor x (n elements) at step t, on every rank r of N, with K = 2^(bits−1) − 1:

    1. Rotate (``rotate=True``): pad x with zeros to d = 2^⌈log2 n⌉ and take
       x' = H·D·x/√d, D = diag(±1) from blake2b(seed, name, t), equal on every rank
       (:func:`rotation_signs`), H/√d the orthonormal Walsh–Hadamard transform
       (:func:`hadamard`). It spreads a spike over all coordinates, so one scale fits
       them all. ``rotate=False``: x' = x, d = n.
    2. Pre-round (:meth:`preround`, once per fusion group): m_r = max|x'| on rank r; one
       allgather of the group's maxima (4 bytes per tensor); M = max_r m_r, the same on
       every rank. M travels in the ctx (it is not summed), the payload is the codes only.
    3. Quantize: u = x'·K/M ∈ [−K, K] (0 when M = 0), q = ⌊u⌋ + Bernoulli(u − ⌊u⌋) from
       rank r's own stream (blake2b(seed + r, name, t)): E[q] = u, q ∈ [−K, K].
    4. Sum: the allreduce adds the codes, Σ_r q_r ∈ [−N·K, N·K]. The wire dtype holds that
       sum: int8 while N·K ≤ 127 (bits ≤ 7 at N = 2, ≤ 6 at N = 3, 4 bits up to N = 18),
       else int32 (gloo and NCCL sum both; neither sums int16). No sum wraps around.
    5. Decode (linear, so the sum decodes without knowing N): x̂' = (Σ_r q_r)·M/K, then
       x̂ = D·H·x̂'/√d truncated to n, reshaped, cast to the input's dtype; Grace divides
       by N. Under allgather the codes are summed in int32 first, then decoded once.

    Unbiased: E[x̂_r] = x_r for any fixed D, and E‖x̂_r − x_r‖² ≤ d·(M/K)²/4.

    Bytes per tensor and rank: d·w with w = 1 (int8) or 4 (int32) for the codes, plus the
    pre-round's 4 bytes sent (and (N−1)·4 received). The codes are not packed to ``bits``:
    the sum needs the wider type, so ``bits`` buys resolution, the wire width is w.
    Only allreduce, allgather and broadcast run the pre-round; compressing without it on
    several ranks is an error. A NaN or Inf makes M non-finite on every rank: outputs NaN.
    """

    SETTINGS: ClassVar[tuple[str, ...]] = ("bits", "rotate", "seed")
    RANK_LOCAL: ClassVar[dict[str, str]] = {
        **StochasticCompressor.RANK_LOCAL,
        "_agreed": "the pre-round's rotated tensors, D and M, kept from preround to the compress "
        "of the same step and removed there",
    }
    prerounds = summable = average = sends_all = True
    chunkable = False
    size = 1  # the world size (Grace binds it): it sets the wire dtype

    def __init__(self, bits: int = 4, rotate: bool = True, seed: int = 0) -> None:
        super().__init__(seed)
        self.bits = check_range("bits", bits, 2, 8, kind=int)
        self.rotate = check_bool("rotate", rotate)
        self.levels = 2 ** (self.bits - 1) - 1  # K
        self._agreed: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.int8 if self.size * self.levels <= 127 else torch.int32

    def bind(self, engine: Engine) -> None:
        super().bind(engine)
        self.size = engine.size

    def rotated(self, tensor: Tensor, name: str) -> tuple[Tensor, Tensor | None]:
        """Step 1: (x', D) for this step of ``name`` (x' may alias a float32 input: read only)."""
        flat = tensor.detach().reshape(-1).float()
        if not self.rotate:
            return flat, None
        d = 1 << max(flat.numel() - 1, 0).bit_length()
        signs = rotation_signs(self.seed, name, self.steps.get(name, 0), d, flat.device)
        padded = torch.zeros(d, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        return hadamard(padded.mul_(signs)), signs

    def preround(self, tensors: Sequence[Tensor], names: Sequence[str], engine: Engine) -> None:
        """Step 2: one allgather of the group's maxima; M per tensor, kept for compress."""
        rotated = [self.rotated(t, n) for t, n in zip(tensors, names)]
        local = torch.stack([_largest(x) for x, _ in rotated])
        scales = torch.stack(engine.allgather(local.to(engine.control_device))).amax(dim=0).to(local.device)
        for name, (x, signs), scale in zip(names, rotated, scales):
            self._agreed[name] = (x, scale, signs)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, THCContext]:
        agreed = self._agreed.pop(name, None)
        if agreed is None:  # no pre-round: its own scale, right only on one rank
            if self.size > 1:
                raise GraceConfigError(
                    f"thc: no scale agreed for {name!r}: on {self.size} ranks it runs under Grace with "
                    "allreduce, allgather or broadcast, whose pre-round agrees on it"
                )
            x, signs = self.rotated(tensor, name)
            agreed = (x, _largest(x), signs)
        x, scale, signs = agreed
        K = self.levels
        u = torch.mul(x, torch.where(scale > 0, K / scale, 0.0))  # a new tensor: x is never written
        u.nan_to_num_(nan=0.0, posinf=K, neginf=-K).clamp_(-K, K)  # M non-finite: decodes to NaN
        uniform = torch.rand(u.numel(), generator=self.generator(name, u.device), device=u.device)
        q = torch.floor(u)
        q.add_(uniform.lt_(u.sub_(q)))
        return [q.to(self.wire_dtype)], THCContext(tensor.shape, tensor.dtype, scale, signs)

    def decompress_into(self, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """Step 5 for codes (one rank's, or their sum) under ``ctx`` (a :class:`THCContext`)."""
        context: THCContext = ctx
        x = payload[0].to(torch.float32).mul_(context.scale.to(payload[0].device) / self.levels)
        if context.signs is not None:
            x = hadamard(x).mul_(context.signs)
        return out.copy_(x[: out.numel()].view(out.shape))

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        context: THCContext = ctx
        out = torch.empty(context.shape, dtype=context.dtype, device=payload[0].device)
        return self.decompress_into(payload, ctx, out)

    def decompress_aggregate_into(self, payloads: Sequence[Payload], ctx: Any, out: Tensor) -> Tensor:
        total = torch.stack([p[0].to(torch.int32) for p in payloads]).sum(dim=0, dtype=torch.int32)
        return self.decompress_into([total], ctx, out)
