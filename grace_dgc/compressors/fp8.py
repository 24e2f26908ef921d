from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from .. import kernels
from ..errors import check_choice, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import for_chunks
from .packed import PackedCompressor, Shaped

T = TypeVar("T")

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Decoding on a CPU, where torch's fp8 -> fp32 cast is scalar code: each code's bits moved into
# an fp16's (vectorized int16 ops, then the vectorized fp16 -> fp32 cast). e5m2 is the top byte of
# an fp16; e4m3's bits SEEEEMMM go to S0EEEEMMM0000000, the fp16 of its value · 2^-8 (normal and
# subnormal alike), so the block's scale is taken · 2^8 (exact). NaN codes (e4m3: S1111111; e5m2:
# S11111MM, MM ≠ 0) get the cast's own NaN bits afterwards: torch's fp16 -> fp32 cast gives NaNs
# other bits in its scalar tail than in its vector body.
FP16_SHIFT = {"e4m3": 7, "e5m2": 8}
FP16_FACTOR = {"e4m3": 2.0**8, "e5m2": 1.0}
FIRST_NAN = {"e4m3": 0x7F, "e5m2": 0x7D}  # a code is NaN where its low 7 bits are at least this
_CAST_BITS = {name: torch.arange(256, dtype=torch.uint8).view(dtype).float() for name, dtype in FORMATS.items()}
NAN_BITS = {  # format -> {NaN code as int8: the cast's fp32 bits as int32}
    name: {
        int(code): int(bits)
        for code, bits in zip(torch.arange(256, dtype=torch.uint8).view(torch.int8), cast.view(torch.int32))
        if bool(torch.isnan(cast[int(code) & 0xFF]))
    }
    for name, cast in _CAST_BITS.items()
}


@register_compressor("fp8", aliases=("float8",))
class FP8Compressor(PackedCompressor):
    """FP8 with a scale per block of ``block`` elements (ZeRO++'s qgZ and torchao's float8
    all-gather use blocks and per-tensor scales; MX formats blocks of 32):

        s_b = max_{i∈b} |x_i| / F    (F: the format's largest finite value, 448 for e4m3,
                                      57344 for e5m2; s_b = 1 for an all-zero block)
        q_i = fp8(x_i / s_b)          (torch's cast: round to nearest even, |q_i| ≤ F)
        D(q)_i = s_b · fp32(q_i)

    Why a block scale and no summing in fp8: the scale maps each block's largest magnitude
    onto the format's largest finite value, so nothing overflows to inf and the small
    values of a block keep the format's relative precision (e4m3: 3 mantissa bits, about
    6 % per element; e5m2: 2 bits and a wider range). Payloads under different scales
    cannot be summed as they travel — and neither gloo nor NCCL before 2.24 sums fp8 — so
    the sum is taken in fp32 after the exchange: with ``reduce_scatter`` (the bytes of a
    ring allreduce: each owner sums its chunk in fp32 and sends it back requantized, its
    error kept), allgather, hierarchical, DDP's hook and FSDP2's reduce-scatter; the plain
    ``allreduce`` communicator refuses it.

    Wire: one byte per element (the fp8 codes, viewed as uint8 to travel), then one fp32
    scale per block: n + 4·⌈n/block⌉ bytes.

    On a GPU both directions are one Triton kernel each (:func:`grace_dgc.kernels.fp8_encode`,
    the rounding done on the bits), bit for bit the torch ops below: under Triton's interpreter
    here, compiled on an H100 (2026-12-05).

    Plain reference: ``tests/core/test_sparseloco.py::reference_fp8`` (each block divided by its
    scale in float64, cast through torch's float8 dtype, multiplied back).
    """

    biased = True  # round to nearest
    chunkable = True

    SETTINGS = ("format", "block")

    def __init__(self, format: str = "e4m3", block: int = 256) -> None:
        self.format = check_choice("format", format, FORMATS)
        self.block = check_range("block", block, 1, kind=int)
        self.dtype = FORMATS[format]
        self.largest = float(torch.finfo(self.dtype).max)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()
        n, block = flat.numel(), self.block
        fused = self._fused(lambda: kernels.fp8_encode(flat, block, self.format), flat) if n else None
        if fused is not None:  # a GPU: one read of the gradient, bit for bit these ops
            return list(fused), (tensor.shape, tensor.dtype)
        codes = torch.empty(n, dtype=self.dtype, device=flat.device)
        scales = flat.new_empty(-(-n // block))
        for_chunks(partial(self._encode_chunk, flat, codes, scales), n, flat.device, block)
        return [codes.view(torch.uint8), scales], (tensor.shape, tensor.dtype)

    def _encode_chunk(self, flat: Tensor, codes: Tensor, scales: Tensor, start: int, stop: int) -> None:
        """Elements ``start:stop`` (whole blocks, but for the tensor's last): their blocks'
        scales and codes, the temporaries in this worker's scratch (they stay in cache)."""
        block = self.block
        first, count = start // block, -(-(stop - start) // block)
        magnitude = self.workspace.get("abs", count * block, flat.dtype, flat.device)
        torch.abs(flat[start:stop], out=magnitude[: stop - start])
        magnitude[stop - start :].zero_()  # the tensor's last, partial block: zeros never raise a max
        mine = scales[first : first + count]
        # by a tensor on the data's device: CUDA divides by a Python scalar as a multiply by its
        # reciprocal (1 ulp off), the kernel and the CPU divide correctly rounded
        torch.amax(magnitude.view(count, block), dim=1, out=mine).div_(flat.new_full((1,), self.largest))
        mine.masked_fill_(torch.gt(mine, 0).logical_not_(), 1.0)  # an all-zero block (or NaN): 1
        whole = (stop - start) // block
        scaled = torch.div(
            flat[start : start + whole * block].view(whole, block),
            mine[:whole, None],
            out=magnitude[: whole * block].view(whole, block),
        )
        codes[start : start + whole * block].copy_(scaled.view(-1))
        if whole < count:
            codes[start + whole * block : stop].copy_(flat[start + whole * block : stop] / mine[whole])

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        codes, scales = payload
        n, block = codes.numel(), self.block
        if n and out.dtype == torch.float32 and out.is_contiguous():
            launch = lambda: kernels.fp8_decode(codes, scales, block, self.format, out.view(-1))  # noqa: E731
            if self._fused(launch, codes) is not None:
                return out
        if codes.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
            for_chunks(partial(self._decode_chunk, codes.view(torch.int8), scales, out.view(-1)), n, "cpu", block)
            return out
        values = codes.view(self.dtype).float()
        pad = (-n) % block
        if not pad and out.dtype == values.dtype and out.is_contiguous():  # one pass, straight into out
            torch.mul(values.view(-1, block), scales[:, None], out=out.view(-1, block))
            return out
        if pad:
            values = torch.nn.functional.pad(values, (0, pad))
        out.view(-1).copy_(values.view(-1, block).mul_(scales[:, None]).view(-1)[:n])
        return out

    def _decode_chunk(self, codes: Tensor, scales: Tensor, out: Tensor, start: int, stop: int) -> None:
        """Elements ``start:stop`` (whole blocks, but for the tensor's last) on a CPU, through
        their fp16 bit patterns (see :data:`FP16_SHIFT`): the cast's bits for every code."""
        mine, block = codes[start:stop], self.block
        bits = self.workspace.get("fp16 bits", stop - start, torch.int16, codes.device)
        bits.copy_(mine).bitwise_left_shift_(FP16_SHIFT[self.format])  # int8 -> int16 sign-extends
        if self.format == "e4m3":
            bits.bitwise_and_(~0x4000)  # the sign's copy that sign extension left in bit 14
        piece = out[start:stop].copy_(bits.view(torch.float16))
        first, whole = start // block, (stop - start) // block
        factor = FP16_FACTOR[self.format]
        if whole:
            piece[: whole * block].view(whole, block).mul_(scales[first : first + whole, None] * factor)
        if whole * block < stop - start:  # the tensor's last, partial block
            piece[whole * block :].mul_(scales[first + whole] * factor)
        # any NaN code? by numpy on the bytes: torch's 8-bit and/compare/any took 35x as long
        magnitudes = self.workspace.get("code magnitudes", stop - start, torch.uint8, codes.device).numpy()
        if np.bitwise_and(mine.numpy().view(np.uint8), 0x7F, out=magnitudes).max() >= FIRST_NAN[self.format]:
            for code, nan in NAN_BITS[self.format].items():
                piece.view(torch.int32).masked_fill_(torch.eq(mine, code), nan)

    def _fused(self, launch: Callable[[], T], tensor: Tensor) -> T | None:
        if self.block > kernels.FP8_LARGEST_BLOCK:
            return None
        return kernels.attempt(launch, tensor.device, kernel="fp8")
