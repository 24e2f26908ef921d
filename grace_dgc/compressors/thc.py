"""THC: summable quantization on one scale agreed by all ranks, carried by a plain allreduce."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .. import kernels
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
    return _butterflies(x.clone())


def _butterflies(a: Tensor) -> Tensor:
    """:func:`hadamard` of ``a`` in the place of ``a`` (consumed: the result is ``a`` or a new
    buffer of its size). Stage h writes a + b and a − b for each pair (i, i + h), in ``a``'s
    dtype; :func:`grace_dgc.kernels.rotate` runs the same stages on tiles held in registers,
    several per pass over memory, bit for bit."""
    d = a.numel()
    b, h = torch.empty_like(a), 1
    while h < d:
        pairs, into = a.view(-1, 2, h), b.view(-1, 2, h)
        torch.add(pairs[:, 0], pairs[:, 1], out=into[:, 0])
        torch.sub(pairs[:, 0], pairs[:, 1], out=into[:, 1])
        a, b, h = b, a, 2 * h
    return a.mul_(d**-0.5)


def rotate(flat: Tensor, signs: Tensor) -> Tensor:
    """x' = H·D·x/√d (step 1) for the fp32 vector ``flat`` zero-padded to d = len(signs): a new
    fp32 tensor. The fused kernels where they run (:func:`grace_dgc.kernels.rotate`: 3 passes
    over memory at d = 2^25), else the torch ops (two per stage); the same bits either way."""
    fused = kernels.attempt(lambda: kernels.rotate(flat, signs), flat.device, flat.dtype)
    if fused is not None:
        return fused
    n = flat.numel()
    padded = torch.empty(signs.numel(), dtype=torch.float32, device=flat.device)
    torch.mul(flat, signs[:n], out=padded[:n])
    torch.mul(signs[n:], 0.0, out=padded[n:])  # the zero padding times D: ±0, as zeros·D
    return _butterflies(padded)


def unrotate(codes: Tensor, factor: Tensor, signs: Tensor, out: Tensor) -> None:
    """``out`` (fp32, contiguous, 1-D, n elements) = the first n of D·H·(codes·factor)/√d
    (step 5), codes·factor rounded to fp32 first: the fused kernels where they run, else the
    torch ops; the same bits either way."""
    if kernels.attempt(lambda: kernels.unrotate(codes, factor, signs, out), codes.device, torch.float32) is not None:
        return  # else the torch ops write all of out
    x = _butterflies(codes.to(torch.float32).mul_(factor))
    n = out.numel()
    torch.mul(x[:n], signs[:n], out=out)


def rotation_signs(seed: int, name: str, step: int, d: int, device: torch.device | str) -> Tensor:
    """The ±1 diagonal D of the ``step``-th rotation of tensor ``name`` (float32): drawn from
    blake2b(seed, name, step), without the rank, so every rank rotates alike."""
    key = f"thc-rotation\0{seed}\0{name}\0{step}".encode()
    derived = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    generator = torch.Generator(device=device).manual_seed(derived)
    return torch.randint(0, 2, (d,), generator=generator, device=device, dtype=torch.float32).mul_(2).sub_(1)


def stochastic_codes(x: Tensor, uniform: Tensor, factor: Tensor, levels: int, dtype: torch.dtype) -> Tensor:
    """Step 3: u = x·factor (K/M, or 0 where M = 0) clamped to [−K, K] (NaN → 0: M non-finite
    decodes to NaN), codes ⌊u⌋ + (uniform < u − ⌊u⌋) as ``dtype``; x is never written. One
    fused kernel where the kernels run (:func:`grace_dgc.kernels.stochastic_codes`), else
    the torch ops; the same codes either way."""
    fused = kernels.attempt(lambda: kernels.stochastic_codes(x, uniform, factor, levels, dtype), x.device, x.dtype)
    if fused is not None:
        return fused
    u = torch.mul(x, factor)  # a new tensor
    u.nan_to_num_(nan=0.0, posinf=levels, neginf=-levels).clamp_(-levels, levels)
    q = torch.floor(u)
    q.add_(uniform.lt_(u.sub_(q)))
    return q.to(dtype)


def _largest(x: Tensor) -> Tensor:
    """max |x| (0 for no element; NaN if one is) in one read of x and no temporary: max(max x,
    −min x), its sign cleared (+0 where every x is ±0, as |x|'s largest)."""
    if not x.numel():
        return x.new_zeros(())
    low, high = torch.aminmax(x)  # both propagate NaN
    return torch.maximum(high, low.neg_()).abs_()


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

    On a GPU the rotations (steps 1 and 5) and the rounding (step 3) run as fused Triton
    kernels (:func:`grace_dgc.kernels.rotate`, ``unrotate``, ``stochastic_codes``): a few
    passes over memory instead of log2 d each way, the same bits as the torch ops.

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
        return rotate(flat, signs), signs

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
        factor = torch.where(scale > 0, K / scale, 0.0)
        uniform = torch.rand(x.numel(), generator=self.generator(name, x.device), device=x.device)
        codes = stochastic_codes(x, uniform, factor, K, self.wire_dtype)
        return [codes], THCContext(tensor.shape, tensor.dtype, scale, signs)

    def decompress_into(self, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """Step 5 for codes (one rank's, or their sum) under ``ctx`` (a :class:`THCContext`)."""
        context: THCContext = ctx
        codes = payload[0]
        factor = context.scale.to(codes.device) / self.levels
        if context.signs is None:
            return out.copy_(codes.to(torch.float32).mul_(factor)[: out.numel()].view(out.shape))
        direct = out.dtype == torch.float32 and out.is_contiguous() and out.device == codes.device
        flat = out.view(-1) if direct else torch.empty(out.numel(), dtype=torch.float32, device=codes.device)
        unrotate(codes, factor, context.signs, flat)
        return out if direct else out.copy_(flat.view(out.shape))

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        context: THCContext = ctx
        out = torch.empty(context.shape, dtype=context.dtype, device=payload[0].device)
        return self.decompress_into(payload, ctx, out)

    def decompress_aggregate_into(self, payloads: Sequence[Payload], ctx: Any, out: Tensor) -> Tensor:
        total = torch.stack([p[0].to(torch.int32) for p in payloads]).sum(dim=0, dtype=torch.int32)
        return self.decompress_into([total], ctx, out)
