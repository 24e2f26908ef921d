import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .. import kernels, wire
from ..errors import GraceConfigError, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import for_chunks
from .sparse import SparseCompressor, SparseContext, SparseCtx, sent_whole

MAX_CHUNK = 2**16  # local indices of at most 16 bits
# elements a CPU worker selects in at a time: the selection is ~20 small ops a run of rows, and
# below ~2M elements their overhead costs more than the cache saves (25M elements, 2 threads:
# 512K-element runs 9.9× one copy_, 2M 7.8×)
SELECT_RUN = 1 << 21
# a magnitude's bits as a signed integer of its width (the same order for floats ≥ 0), and the
# bits of the first NaN above ∞; the CPU selects on them where key·2^16 fits an int64
INTEGER_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
FIRST_NAN = {torch.float32: 0x7F800001, torch.float16: 0x7C01, torch.bfloat16: 0x7F81}


def group_size(chunk: int, k: int) -> int:
    """The group of :meth:`ChunkTopKCompressor._top_k`'s first round: the power of two s
    nearest √(C/k) that divides C (the two rounds then see C/s + k·s elements, least near
    s = √(C/k)), or 1 (one round) where the two would see more than half the chunk."""
    s = 1 << max(0, round(math.log2(math.sqrt(chunk / k))))
    while s > 1 and chunk % s:
        s //= 2
    return s if s > 1 and chunk // s >= k and chunk // s + k * s <= chunk // 2 else 1


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's bits as integers where it has a width :data:`INTEGER_OF` knows: a gather of
    them copies NaNs' payloads exactly (a float gather may quiet a signalling NaN)."""
    integer = INTEGER_OF.get(tensor.dtype)
    return tensor if integer is None else tensor.view(integer)


def _largest(keys: Tensor, low: Tensor, k: int, bits: int, first_nan: int | None) -> Tensor:
    """The labels of the k largest of each row of ``keys`` (magnitudes, ≥ 0), in no order; a
    key's label is 2^bits − 1 − ``low`` (int64, broadcast to ``keys``). Given the magnitudes'
    bits on a CPU and the bits of their dtype's first NaN, ties go to the lowest label and every
    NaN is alike (above ∞): numpy's SIMD ``partition`` of min(key, ``first_nan``)·2^bits + low,
    three times as fast as torch's ``topk``. Otherwise ``torch.topk``'s."""
    top = (1 << bits) - 1
    if first_nan is None:
        return low.expand(keys.shape).gather(1, torch.topk(keys, k, dim=1, sorted=False).indices).neg_().add_(top)
    ranked = keys.to(torch.int64).clamp_(max=first_nan).bitwise_left_shift_(bits).add_(low)
    ranked.numpy().partition(ranked.shape[1] - k, axis=1)
    return ranked[:, -k:].bitwise_and(top).neg_().add_(top)


@register_compressor("chunk_topk", aliases=("chunked_topk",))
class ChunkTopKCompressor(SparseCompressor):
    """Top-k within each chunk of ``chunk`` consecutive elements (SparseLoCo, Sarfi et al.
    2025, arXiv 2508.15706, after DeMo's chunking; the chunk-local index codes of both).

    The flattened tensor is cut into chunks of C = ``chunk`` elements; each keeps its k
    largest magnitudes, and a last partial chunk of r < C elements keeps ⌈k·r/C⌉ (the same
    density, at least one):

        S = ⋃_c { cC + j : j ∈ argtop_k |g_{cC : (c+1)C}| },   |S| = ⌊n/C⌋·k + ⌈k·(n mod C)/C⌉

    Every chunk sends the same count, so the position of an entry in the payload says its
    chunk, and an index travels as its offset inside the chunk in b = ⌈log2 C⌉ bits (12 for
    C = 4096) instead of a 32-bit position: ``[values, offsets packed b bits each]``
    (wire.pack_bits), both ascending. A fixed count on every rank, so a chain may quantize
    the values (``chunk_topk>statq`` is SparseLoCo's compressor).

    Deviation: the chunks are runs of the flattened tensor, where SparseLoCo's code tiles a
    2-D weight in 64×64 blocks; both keep k of every C entries. The offsets are chunk-local,
    so ``sparse_allreduce`` (which sums global positions) does not carry this compressor;
    allgather and broadcast do.

    Plain reference: ``tests/core/test_chain.py::reference_chunk_topk`` (a Python loop over the
    chunks with ``sorted(range(C), key=|g|)``) equal index for index; on a CPU also the
    definition's ties (the lowest offsets) and NaNs, as the kernel
    (``tests/core/test_kernels.py::test_chunk_topks_cpu_path_is_each_chunks_top_k_by_definition``).
    """

    fixed_count = True
    chunk_local = True  # the offsets are chunk-local: sparse_allreduce refuses it

    SETTINGS = ("chunk", "k")

    def __init__(self, chunk: int = 4096, k: int = 64) -> None:
        self.chunk = check_range("chunk", chunk, 1, MAX_CHUNK, kind=int)
        self.k = check_range("k", k, 1, kind=int)
        if self.k > self.chunk:
            raise GraceConfigError(f"k={k} is more than a chunk holds (chunk={chunk}); accepted: 1 ≤ k ≤ chunk")
        self.offset_bits = max(1, (self.chunk - 1).bit_length())
        self.group = group_size(self.chunk, self.k)

    def counts(self, n: int) -> tuple[int, int]:
        """(whole chunks, what the last partial chunk keeps) for a tensor of ``n`` elements."""
        whole, rest = divmod(n, self.chunk)
        return whole, math.ceil(self.k * rest / self.chunk)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, SparseContext]:
        flat = tensor.reshape(-1)
        whole, tail_k = self.counts(flat.numel())
        cut, kept = whole * self.chunk, whole * self.k
        local = torch.empty(kept + tail_k, dtype=torch.int64, device=flat.device)
        values = flat.new_empty(kept + tail_k)
        if whole:
            launch = lambda: kernels.chunk_top_k(flat[:cut], self.chunk, self.k, local[:kept], values[:kept])  # noqa: E731
            fused = self.chunk <= kernels.CHUNK_TOP_LARGEST and kernels.attempt(
                launch, flat.device, flat.dtype, kernel="chunk_top_k"
            ) is not None  # fmt: skip
            if not fused:
                self._whole_chunks(flat[:cut].view(whole, self.chunk), local[:kept], values[:kept])
        if tail_k:
            tail = flat[cut:]
            local[kept:] = self._top_k(tail.abs().view(1, -1), tail_k, 1).view(-1)
            torch.index_select(_bits(tail), 0, local[kept:], out=_bits(values[kept:]))
        return [values, wire.pack_bits(local, self.offset_bits)], SparseContext(tensor.shape, tensor.dtype)

    def _whole_chunks(self, blocks: Tensor, offsets: Tensor, values: Tensor) -> None:
        """Into ``offsets`` and ``values`` (chunks·k each): argtop_k |row| of each row of
        ``blocks`` (chunks × C), ascending, and the elements there; a run of rows at a time in
        cache (|x| in a workspace buffer) on the CPU's workers (:func:`~grace_dgc.workspace.for_chunks`)."""
        c, k = self.chunk, self.k
        flat = blocks.reshape(-1)

        def select(start: int, stop: int) -> None:
            part = flat[start:stop].view(-1, c)
            magnitudes = self.workspace.get("abs", stop - start, part.dtype, part.device).view(-1, c)
            picked = self._top_k(torch.abs(part, out=magnitudes), k, self.group)
            rows = slice(start // c * k, stop // c * k)
            offsets[rows] = picked.view(-1)
            torch.gather(_bits(part), 1, picked, out=_bits(values[rows]).view(-1, k))

        for_chunks(select, flat.numel(), blocks.device, multiple=c, largest=SELECT_RUN)

    def _top_k(self, magnitudes: Tensor, k: int, s: int) -> Tensor:
        """argtop_k of each row of ``magnitudes`` (rows × C, ≥ 0), ascending.

        In two rounds where s > 1 (the chunk is long against k): cut each row into C/s groups of s
        consecutive elements and keep the k groups with the largest peaks, then take the top k
        of their k·s members. Exact, not a sketch: an element of the top k lies in a group
        whose peak is at least its own, and fewer than k groups can peak above that (each
        would hold a larger element), so its group is among the k kept. For C = 4096, k = 64
        (s = 8) the two selections see 512 + 512 elements of a chunk instead of 4096.

        On a CPU (fp32, fp16, bf16) both rounds put ties at the lowest label (:func:`_largest`),
        and since a lower group holds only lower offsets, the result is the definition's, ties
        to the lowest offsets and NaNs alike, as the GPU kernel's; the rows come out sorted by
        numpy's SIMD ``sort`` (torch's sorts rows of 64 ten times slower). Elsewhere (fp64, an
        accelerator without the kernel) ties go where ``torch.topk`` puts them."""
        rows, c = magnitudes.shape
        g = c // s
        integer = INTEGER_OF.get(magnitudes.dtype) if magnitudes.device.type == "cpu" else None
        keys = magnitudes if integer is None else magnitudes.view(integer)
        bits, device, nan = self.offset_bits, magnitudes.device, FIRST_NAN.get(magnitudes.dtype) if integer else None
        top = (1 << bits) - 1  # the low bits of a key: top − label
        if s == 1:
            offsets = _largest(keys, torch.arange(top, top - c, -1, device=device).view(1, c), k, bits, nan)
        else:
            if integer is None:
                peaks = magnitudes.view(rows, g, s).amax(dim=2)
            else:  # torch's CPU max_pool1d is 3x its amax over a last dim of s
                peaks = torch.nn.functional.max_pool1d(magnitudes.view(rows, 1, c), s).view(rows, g).view(integer)
            kept = _largest(peaks, torch.arange(top, top - g, -1, device=device).view(1, g), k, bits, nan)
            first = torch.arange(0, rows * g, g, device=device).unsqueeze(1)
            members = keys.view(-1, s).index_select(0, kept.add(first).view(-1)).view(rows, k * s)
            low = kept.mul(-s).add_(top).unsqueeze(2).sub(torch.arange(s, device=device))  # top − (s·group + i)
            offsets = _largest(members, low.view(rows, k * s), k, bits, nan)
        if integer is None:
            return offsets.sort(dim=1).values
        return torch.from_numpy(np.sort(offsets.to(torch.int32).numpy(), axis=1)).long()

    def _positions_(self, local: Tensor) -> Tensor:
        """The chunk-local offsets (int64) made global in place: the i-th is in chunk ⌊i/k⌋."""
        whole = local.numel() // self.k
        starts = torch.arange(0, (whole + 1) * self.chunk, self.chunk, device=local.device)
        local[: whole * self.k].view(whole, self.k).add_(starts[:whole].unsqueeze(1))
        local[whole * self.k :].add_(starts[whole])  # the partial last chunk's few
        return local

    def _global(self, payload: Payload, ctx: SparseCtx) -> Payload:
        """The payload in the common sparse format: values and int64 positions."""
        if sent_whole(ctx):
            return payload
        values, packed = payload
        return [values, self._positions_(wire.unpack_bits(packed, self.offset_bits, values.numel()).long())]

    def decompress(self, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().decompress(self._global(payload, ctx), ctx)

    def decompress_into(self, payload: Payload, ctx: SparseCtx, out: Tensor) -> Tensor:
        return super().decompress_into(self._global(payload, ctx), ctx, out)

    def decompress_aggregate(self, payloads: Sequence[Payload], ctx: SparseCtx) -> Tensor:
        return super().decompress_aggregate([self._global(p, ctx) for p in payloads], ctx)

    def decompress_aggregate_into(self, payloads: Sequence[Payload], ctx: SparseCtx, out: Tensor) -> Tensor:
        return super().decompress_aggregate_into([self._global(p, ctx) for p in payloads], ctx, out)

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().subtract_sent_(tensor, self._global(payload, ctx), ctx)

    def sent_mask(self, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().sent_mask(self._global(payload, ctx), ctx)

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: SparseCtx) -> Tensor:
        return super().mask_sent_(tensor, self._global(payload, ctx), ctx)
