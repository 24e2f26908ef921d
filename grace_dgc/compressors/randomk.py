"""Random-k with indices every rank computes alike, on the tensor's own device.

S_t is the first k outputs of a keyed pseudo-random permutation π of range(n): π(0), …, π(k−1)
are distinct by construction, so no draw with replacement, no ``unique`` and no permutation of
n. π is a Feistel network over bit strings of ⌈log2 n⌉ bits (halves of a and b bits, swapping
widths each round), walked back into range(n) ("cycle walking": π(x) ≥ n is permuted again;
the domain is < 2n, so under 2 walks on average):

    round r:   x = A·2^b + B  ↦  B·2^a + (A ⊕ (F(B, K_r) mod 2^a)),   (a, b) ← (b, a)
    F(v, K)   = a 32-bit integer hash of v ⊕ K (xorshift-multiply, products kept below 2^63)
    K_0…K_5   = splitmix64 of (seed, crc32(name), t), 31 bits each

Every value is an integer function of (seed, name, t, i): the same bits on every rank, on the
CPU and on any GPU, by the torch ops below or by one Triton kernel
(:func:`grace_dgc.kernels.random_indices`, bit for bit the torch ops under Triton's interpreter
and compiled on an H100), with no host generator
and no copy from the host. Six rounds of a keyed hash make π indistinguishable from a random
permutation for this purpose (Luby–Rackoff needs four); the tests check that each index is kept
with probability k/n and that kept pairs are not correlated with their distance.
"""

import zlib

import torch
from torch import Tensor

from .. import kernels
from ..errors import check_range
from ..interfaces import Compressor, Payload
from ..registry import register_compressor
from ..workspace import for_chunks
from .sparse import scatter_into, subtract_at_

ROUNDS = 6
MASK32 = 0xFFFFFFFF
KEY_MASK = 0x7FFFFFFF  # 31-bit keys: a Triton kernel takes them as int32 whatever their value (no recompiling)
PERMUTE_CHUNK = 1 << 16  # indices permuted per pass of the torch ops
MAX_BITS = 62  # a half of at most 31 bits: the hash's products stay below 2^63


def round_keys(seed: int, name: str, step: int) -> list[int]:
    """The ``ROUNDS`` 31-bit keys of tensor ``name`` at ``step``: splitmix64's outputs from a
    state mixing the three (integer arithmetic: the same on every rank and platform)."""
    state = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode()) * 0xBF58476D1CE4E5B9 + step) % 2**64
    keys = []
    for _ in range(ROUNDS):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        keys.append((z ^ (z >> 31)) & KEY_MASK)
    return keys


def _hash(v: Tensor, key: int) -> Tensor:
    """F(v, K) for int64 ``v`` < 2^31 (the Triton kernel's ``mix``, op for op)."""
    h = v ^ key
    h ^= h >> 16
    h.mul_(0x7FEB352D).bitwise_and_(MASK32)
    h ^= h >> 15
    h.mul_(0x5BD1E995).bitwise_and_(MASK32)
    return h.bitwise_xor_(h >> 16)


def permute(x: Tensor, bits: int, keys: list[int]) -> Tensor:
    """π(x) over ``bits``-bit integers (int64 ``x``), the rounds of the module's docstring."""
    a, b = bits // 2, bits - bits // 2
    for key in keys:
        low = x & ((1 << b) - 1)
        high = x.bitwise_right_shift_(b).bitwise_xor_(_hash(low, key).bitwise_and_((1 << a) - 1))
        x = low.bitwise_left_shift_(a).bitwise_or_(high)
        a, b = b, a
    return x


def keyed_indices(n: int, k: int, keys: list[int], device: torch.device | str = "cpu") -> Tensor:
    """π(0), …, π(k − 1) in range(n): ``k`` distinct int64 indices on ``device``."""
    if not 0 <= k <= n:
        raise ValueError(f"k={k} indices of range({n}): need 0 <= k <= n")
    bits = max(1, (n - 1).bit_length())
    if bits > MAX_BITS:
        raise ValueError(f"random-k over {n} elements: at most 2^{MAX_BITS} are supported")
    device = torch.device(device)
    launch = lambda: kernels.random_indices(n, k, bits, keys, device)  # noqa: E731
    fused = kernels.attempt(launch, device, kernel="random_indices") if k else None
    if fused is not None:
        return fused
    out = torch.empty(k, dtype=torch.int64, device=device)

    def chunk(start: int, stop: int) -> None:
        # π is elementwise: each chunk permutes its own positions, on one thread (for_chunks: no
        # fork-join per op, which a competing process turned into a scheduler tick per op), in
        # pieces that stay in cache (twice as fast on a CPU at k = 250K)
        for first in range(start, stop, PERMUTE_CHUNK):
            last = min(first + PERMUTE_CHUNK, stop)
            x = permute(torch.arange(first, last, dtype=torch.int64, device=device), bits, keys)
            walking = torch.nonzero(x >= n).view(-1)
            while walking.numel():  # the few that landed in [n, 2^bits): permuted again
                again = permute(x[walking], bits, keys)
                x[walking] = again
                walking = walking[again >= n]
            out[first:last] = x

    for_chunks(chunk, k, device)
    return out


def draw_indices(
    seed: int, compress_ratio: float, name: str, numel: int, step: int, device: torch.device | str = "cpu"
) -> Tensor:
    """S_t of tensor ``name`` (``numel`` elements) at ``step``, on ``device``: a function of
    its arguments alone (the same bits on every rank and device)."""
    k = max(1, int(numel * compress_ratio)) if numel else 0
    return keyed_indices(numel, k, round_keys(seed, name, step), device)


@register_compressor("randomk")
class RandomKCompressor(Compressor):
    """Random-k sparsification with indices shared by all ranks (Stich et al. 2018):

        S_t = k distinct indices, π_{seed, name, t}(0 … k−1),   payload = g_{S_t}.

    Every rank computes the same S_t on the gradient's device (the module's docstring: a keyed
    permutation, no generator, the global RNG untouched), so only the k values travel and
    payloads are summable (allreduce). The indices are in draw order, not sorted.
    """

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    summable = True

    SETTINGS = ("compress_ratio", "seed")
    STATE = ("steps",)
    REPLICATED = ("steps",)  # the shared index stream: every rank picks the same coordinates

    def __init__(self, compress_ratio: float = 0.01, seed: int = 0) -> None:
        self.compress_ratio = check_range("compress_ratio", compress_ratio, 0, 1, low_open=True)
        self.seed = check_range("seed", seed, 0, kind=int)
        self.steps: dict[str, int] = {}  # name -> how many times that tensor was compressed

    def indices(self, name: str, numel: int, step: int, device: torch.device | str = "cpu") -> Tensor:
        return draw_indices(self.seed, self.compress_ratio, name, numel, step, device)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, tuple[Tensor, torch.Size]]:
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        flat = tensor.reshape(-1)
        indices = self.indices(name, flat.numel(), step, tensor.device)
        values = flat.new_empty(indices.numel())
        for_chunks(
            lambda start, stop: torch.index_select(flat, 0, indices[start:stop], out=values[start:stop]),
            indices.numel(),
            tensor.device,
        )
        return [values], (indices, tensor.shape)

    def decompress(self, payload: Payload, ctx: tuple[Tensor, torch.Size]) -> Tensor:
        return self.decompress_into(payload, ctx, payload[0].new_empty(ctx[1]))

    def decompress_into(self, payload: Payload, ctx: tuple[Tensor, torch.Size], out: Tensor) -> Tensor:
        return scatter_into(out, [payload[0], ctx[0]])

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
