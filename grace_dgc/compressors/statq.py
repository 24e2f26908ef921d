import math

import numpy as np
import torch
from torch import Tensor

from .. import kernels, wire
from ..errors import GraceConfigError, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import CPU_CHUNK, chunks, for_chunks
from .packed import PackedCompressor, Shaped

BITS = (1, 2, 4, 8)


@register_compressor("statq", aliases=("statistical",))
class StatisticalQuantizer(PackedCompressor):
    """Statistical quantization (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706): b-bit codes
    on a grid scaled by the tensor's standard deviation, decoded to each bin's mean.

    With L = 2^b levels, μ the mean and σ the unbiased standard deviation of x:

        c = x − μ,   s = ρ·σ / L   (ρ = ``range_sigmas``; s = 1 where σ = 0 or is not finite)
        q_i = clamp(round(c_i / s + L/2), 0, L − 1)          (round half to even)
        T_j = mean{ c_i : q_i = j }  (0 for an empty bin),    D(q)_i = T_{q_i} + μ

    so the grid spans about ±ρ/2 σ and each code decodes to the mean of the values it
    stands for (the least-squares value for that bin). Biased (E[D(q)] ≠ x): meant for error
    feedback, as SparseLoCo uses it on top-k's values (``chunk_topk>statq``).

    Wire: the codes packed b bits each (wire.pack_bits), then L + 1 fp32 numbers (μ, then
    T_0 … T_{L−1}): ⌈n·b/8⌉ + 4(L + 1) bytes. The table is per tensor, so payloads cannot be
    summed: allgather or broadcast.

    Plain reference: ``tests/core/test_chain.py::reference_statq`` (a Python loop over the bins in
    float64, then fp32) equal code for code and value for value.
    """

    biased = True

    SETTINGS = ("bits", "range_sigmas")

    def __init__(self, bits: int = 2, range_sigmas: float = 6.0) -> None:
        if bits not in BITS or isinstance(bits, bool):
            raise GraceConfigError(f"bits={bits!r} is out of range; accepted: {', '.join(map(str, BITS))}")
        self.bits = int(bits)
        self.range_sigmas = check_range("range_sigmas", range_sigmas, 0, low_open=True)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()
        if flat.device.type != "cpu" or flat.numel() < 2:  # a GPU sums its bins with atomics at memory speed
            return self._compress_elementwise(flat), (tensor.shape, tensor.dtype)
        levels, n = 1 << self.bits, flat.numel()
        # every sum over fixed chunks in float64, then over the chunks: the same bits whatever the threads
        # (numpy's, which widens a buffer at a time: torch's sum(dtype=float64) first copies the chunk)
        totals = for_chunks(
            lambda a, b: np.add.reduce(flat[a:b].detach().numpy(), dtype=np.float64), n, "cpu", multiple=CPU_CHUNK
        )
        shift = (torch.tensor(totals, dtype=torch.float64).sum() / n).float()

        def squares(start: int, stop: int) -> float:
            centered = self.workspace.get("centered", stop - start, torch.float32, "cpu")
            return np.add.reduce(torch.sub(flat[start:stop], shift, out=centered).square_().numpy(), dtype=np.float64)

        spread = float(torch.tensor(for_chunks(squares, n, "cpu", multiple=CPU_CHUNK), dtype=torch.float64).sum())
        spread = spread**0.5 / math.sqrt(n - 1) * (self.range_sigmas / levels)
        scale = torch.tensor(spread if 0 < spread < math.inf else 1.0)  # fp32, as the elementwise path's
        binned: dict[int, Tensor] = {}  # chunk start -> its bins' sums

        def encode(start: int, stop: int) -> Tensor:
            # the codes and each bin's sum and count, one chunk in cache: no full-size temporary, and
            # no serial scatter over the whole tensor (index_add_ on a CPU walks it on one core)
            size, scratch = stop - start, self.workspace
            centered = torch.sub(flat[start:stop], shift, out=scratch.get("centered", size, torch.float32, "cpu"))
            grid = torch.div(centered, scale, out=scratch.get("grid", size, torch.float32, "cpu"))
            grid.add_(levels // 2).round_()
            # clamped and cast in one numpy pass (torch's clamp_ then float → uint8 cast: 4x the time); the
            # codes are packed in this chunk's worker, but 8-bit codes are the payload and are kept
            kept = self.bits == 8
            codes = torch.empty(size, dtype=torch.uint8) if kept else scratch.get("codes", size, torch.uint8, "cpu")
            with np.errstate(invalid="ignore"):  # a NaN (non-finite statistics) casts to code 0, as torch's did
                np.clip(grid.numpy(), 0, levels - 1, out=codes.numpy(), casting="unsafe")
            # float64 weights in a kept buffer: a fresh 4 MiB one is page-faulted in on every chunk
            weights = scratch.get("weights", size, torch.float64, "cpu").copy_(centered)
            binned[start] = torch.bincount(codes, weights=weights, minlength=levels)
            return codes

        if self.bits == 8:
            packed = torch.cat([encode(a, b) for a, b in chunks(n, "cpu", multiple=CPU_CHUNK)])
        else:  # the same chunks whatever the threads: the sums add up in one order
            packed = wire.pack_chunks(n, self.bits, encode, "cpu", self.workspace, multiple=CPU_CHUNK)
        sums = sum((binned[start] for start in sorted(binned)), torch.zeros(levels, dtype=torch.float64))
        counts = code_counts(packed, self.bits, n)
        table = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).float()
        return [packed, torch.cat([shift.view(1), table])], (tensor.shape, tensor.dtype)

    def _compress_elementwise(self, flat: Tensor) -> Payload:
        """The whole tensor at once (a GPU): codes elementwise, the bins by :func:`bin_sums`."""
        levels, n = 1 << self.bits, flat.numel()
        shift = flat.mean() if n else flat.new_zeros(())
        centered = flat - shift
        sigma = centered.norm() / math.sqrt(n - 1) if n > 1 else flat.new_zeros(())
        scale = sigma * (self.range_sigmas / levels)
        scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
        launch = lambda: kernels.statq_encode(flat, shift.reshape(1), scale.reshape(1), self.bits)  # noqa: E731
        fused = kernels.attempt(launch, flat.device, kernel="statq")  # the codes, packed, and the bins: one read
        if fused is not None:
            packed, sums, counts = fused
        else:
            codes = centered.div(scale).add_(levels // 2).round_().clamp_(0, levels - 1).to(torch.uint8)
            sums, counts = bin_sums(codes, centered, levels)
            packed = wire.pack_bits(codes, self.bits)
        table = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).float()
        return [packed, torch.cat([shift.view(1), table])]

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        packed, header = payload
        values = header[1:] + header[0]  # T_j + μ: one fp32 addition per level, as per element before
        if not wire.lookup_bytes(packed, self.bits, values, out, self.workspace):  # a GPU, or another dtype
            codes = wire.unpack_bits(packed, self.bits, out.numel()).long()
            out.view(-1).copy_(values.index_select(0, codes))
        return out


def code_counts(packed: Tensor, bits: int, n: int) -> Tensor:
    """How many of the ``n`` codes packed ``bits`` each (:func:`~grace_dgc.wire.pack_bits`) are
    0, 1, … 2^bits − 1, from one histogram of the bytes: 8/bits codes a byte, so 2–8× fewer
    elements to count than codes (a histogram's loop is serial: a CPU counts ~1 ns an element)."""
    levels, per = 1 << bits, 8 // bits
    byte_counts = torch.bincount(packed, minlength=256)
    codes_in_byte = (torch.arange(256).view(-1, 1) >> (torch.arange(per) * bits)) & (levels - 1)
    in_byte = torch.zeros(256, levels, dtype=torch.int64).scatter_add_(1, codes_in_byte, torch.ones_like(codes_in_byte))
    counts = byte_counts @ in_byte
    counts[0] -= packed.numel() * per - n  # the last byte's padding codes are 0
    return counts


BIN_ROW = 4096  # elements whose bins are summed into one row of partial sums


def bin_sums(codes: Tensor, values: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """Each bin's sum of ``values`` (float64) and count (int64), by ``codes``, with no host sync.

    One ``index_add_`` into ``levels`` slots has every GPU thread add to the same few addresses:
    27 ms for 25M elements in 4 bins on an H100, 320 copies. Here each row of BIN_ROW elements
    adds into its own ``levels`` slots, and the rows are summed after. The sums are float64, so
    the order the atomics land in changes no bit of the fp32 mean taken from them (``bincount``
    would also sync: it reads the codes' maximum on the host)."""
    n = codes.numel()
    rows = max(1, -(-n // BIN_ROW))
    slot = torch.arange(n, device=codes.device).floor_divide_(BIN_ROW).mul_(levels).add_(codes)
    sums = values.new_zeros(rows * levels, dtype=torch.float64).index_add_(0, slot, values.double())
    one = torch.ones((), dtype=torch.int64, device=codes.device).expand(n)
    counts = torch.zeros(rows * levels, dtype=torch.int64, device=codes.device).index_add_(0, slot, one)
    return sums.view(rows, levels).sum(0), counts.view(rows, levels).sum(0)
