"""Wire format: how a payload (a list of tensors) becomes bytes and back.

A payload travels as one flat ``uint8`` buffer (the tensors' raw bytes, concatenated)
plus a header of per-tensor byte lengths (int64). Receivers rebuild each tensor with the
dtype and trailing shape of their own payload in the same position: every rank runs the
same compressor, so only the leading dimension may differ between ranks.
"""

import math
import numbers
import struct
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import numpy as np
import torch
from torch import Tensor

from . import kernels
from .workspace import Workspace, compare, for_chunks


def as_bytes(tensor: Tensor) -> Tensor:
    """The raw bytes of ``tensor`` as a 1-D uint8 view (a copy only if not dense)."""
    return dense(tensor).reshape(-1).view(torch.uint8)


def dense(tensor: Tensor) -> Tensor:
    """``tensor``, or a contiguous copy when it is not contiguous or its last stride is not 1:
    torch calls a one-element tensor sliced with a step contiguous, yet views of another
    element size (the bytes on the wire, a compressor's bit tricks) refuse its stride."""
    if tensor.is_contiguous() and (tensor.dim() == 0 or tensor.stride(-1) == 1):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def encode(payload: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``payload -> (buffer, header)``: uint8 buffer and int64 per-tensor byte lengths."""
    chunks = [as_bytes(t) for t in payload]
    device = payload[0].device
    header = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
    buffer = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    return buffer, header


def decode(buffer: Tensor, header: Tensor, template: Sequence[Tensor]) -> list[Tensor]:
    """Inverse of :func:`encode`, shaped like ``template`` (this rank's own payload)."""
    lengths = header.tolist()
    out, start = [], 0
    for length, like in zip(lengths, template):
        raw = buffer[start : start + length]
        if (raw.storage_offset() % like.element_size()) != 0:
            raw = raw.clone()  # a view as a wider dtype needs an aligned offset
        start += length
        values = raw.view(like.dtype)
        out.append(values.reshape(like.shape) if like.dim() == 0 else values.reshape(-1, *like.shape[1:]))
    return out


def nbytes(payload: Sequence[Tensor]) -> int:
    """Bytes of a payload as it sits in memory (no header)."""
    return sum(t.numel() * t.element_size() for t in payload)


# -- bit packing: the one implementation every packed method uses ------------------------

MAX_BITS = 32


def _check_bits(bits: object) -> None:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= int(bits) <= MAX_BITS:
        raise ValueError(f"bits={bits!r} is out of range; accepted: integers 1..{MAX_BITS}")


# Masks of the SWAR stages below, per width: after stage j, each 2^(j+4)-bit lane of an
# int64 word holds 2^j·bits packed bits at its bottom (stage 0: pairs of bytes, 1: pairs of
# 16-bit lanes, 2: the two 32-bit halves).
_SWAR_MASKS = {
    1: (0x0003000300030003, 0x0000000F0000000F, 0xFF),
    2: (0x000F000F000F000F, 0x000000FF000000FF, 0xFFFF),
    4: (0x00FF00FF00FF00FF, 0x0000FFFF0000FFFF, 0xFFFFFFFF),
}


# The integer type whose low bytes hold the ``bits`` bytes an int64 word packs to.
_PACKED_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _scratch(
    workspace: Workspace | None, slot: str, numel: int, dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return workspace.get(slot, numel, dtype, device)


def _pack_words(codes: Tensor, bits: int, workspace: Workspace | None) -> Tensor:
    """One chunk of :func:`_pack_aligned`: ``codes`` (uint8, one per byte) → packed bytes."""
    n = codes.numel()
    count = -(-n // 8)
    words = _scratch(workspace, "pack_words", count, torch.int64, codes.device)
    as_bytes = words.view(torch.uint8)  # folded in place: never the caller's codes
    as_bytes[:n].copy_(codes)
    as_bytes[n:].zero_()
    shifted = _scratch(workspace, "pack_shifted", count, torch.int64, codes.device)
    lane, width = 8, bits
    for mask in _SWAR_MASKS[bits]:
        words.bitwise_or_(torch.bitwise_right_shift(words, lane - width, out=shifted)).bitwise_and_(mask)
        lane, width = 2 * lane, 2 * width
    return words.to(_PACKED_WORD[bits]).view(torch.uint8)[: packed_nbytes(n, bits)]


def _pack_host(codes: Tensor, bits: int) -> Tensor:
    """:func:`_pack_words` on a CPU, by numpy (``packbits``; lanes OR-ed for 2 and 4 bits):
    a handful of C loops where the SWAR stages cost a dozen torch calls, which dominate below
    ~1M elements and were measured 2-10x slower at every size."""
    array = codes.numpy().view(np.uint8)
    if bits == 1:
        return torch.from_numpy(np.packbits(array, bitorder="little"))
    per = 8 // bits
    if array.size % per:
        array = np.concatenate([array, np.zeros(-array.size % per, dtype=np.uint8)])
    lanes = array.reshape(-1, per)
    packed = lanes[:, 0].copy()
    for lane in range(1, per):  # 1 or 3 passes over the lanes: code j of a byte at bit j·bits
        packed |= lanes[:, lane] << (lane * bits)
    return torch.from_numpy(packed)


def _unpack_host(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of :func:`_pack_host`: the first ``count`` codes of ``packed`` as uint8."""
    array = packed.numpy()
    if bits == 1:
        return torch.from_numpy(np.unpackbits(array, count=count, bitorder="little"))
    per, mask = 8 // bits, (1 << bits) - 1
    codes = np.empty((array.size, per), dtype=np.uint8)
    for lane in range(per):
        np.bitwise_and(array >> (lane * bits), mask, out=codes[:, lane])
    return torch.from_numpy(codes.reshape(-1)[:count])


def pack_chunks(
    n: int,
    bits: int,
    encode: Callable[[int, int], Tensor],
    device: torch.device | str,
    workspace: Workspace | None = None,
    multiple: int = 8,
) -> Tensor:
    """:func:`pack_bits` of ``n`` codes of 1, 2 or 4 bits that ``encode(start, stop)`` makes
    chunk by chunk (uint8 or bool, one per byte; ``start`` a multiple of 8): a method's
    encoding and the packing then both run in cache, chunks at once on the CPU's workers
    (:func:`~grace_dgc.workspace.for_chunks`: ``encode`` writes only its own chunk), and no
    full-size code tensor exists. ``multiple`` (of 8): every chunk but the last a multiple of it
    (``CPU_CHUNK``: the same chunks whatever the threads, for statistics kept per chunk).

    Packing: on a GPU by one fused kernel (:mod:`grace_dgc.kernels`, the whole tensor as one
    chunk); on a CPU by numpy (:func:`_pack_host`); elsewhere, or with
    ``GRACE_DGC_KERNELS=torch``, eight bytes per int64 word, folded in three shift-or-mask
    stages (SWAR) until the word's low ``bits`` bytes hold its eight codes in stream order, a
    narrowing cast then keeping those bytes. The same stream on every path.
    """
    if bits not in _PACKED_WORD:
        raise ValueError(f"bits={bits!r}; pack_chunks packs 1, 2 or 4 bits")
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=device)
    if n and kernels.enabled(device):
        made = encode(0, n)
        if kernels.attempt(lambda: kernels.pack(made, bits, out=out), device) is not None:
            return out
        encode = partial(_slice_of, made)  # a kernel failed (warned): the codes made are packed, not drawn again

    host = torch.device(device).type == "cpu"

    def pack(start: int, stop: int) -> None:
        codes = encode(start, stop)
        codes = codes.view(torch.uint8) if codes.dtype in (torch.uint8, torch.bool) else codes.to(torch.uint8)
        first = start // 8 * bits
        packed = _pack_host(codes, bits) if host else _pack_words(codes, bits, workspace)
        out[first : first + packed_nbytes(stop - start, bits)] = packed

    for_chunks(pack, n, device, multiple=multiple)
    return out


def _slice_of(codes: Tensor, start: int, stop: int) -> Tensor:
    return codes[start:stop]


def _pack_aligned(codes: Tensor, bits: int, workspace: Workspace | None) -> Tensor:
    """:func:`pack_bits` for bits ∈ {1, 2, 4} (see :func:`pack_chunks`)."""
    flat = codes.reshape(-1)
    return pack_chunks(flat.numel(), bits, lambda start, stop: flat[start:stop], codes.device, workspace)


def _unpack_words(packed: Tensor, bits: int, start: int, stop: int, workspace: Workspace | None) -> Tensor:
    """Codes ``start:stop`` (``start`` a multiple of 8) of a packed stream, as uint8; a
    workspace buffer when one is given."""
    first, size = start // 8 * bits, packed_nbytes(stop - start, bits)
    raw = packed[first : first + size]
    if size % bits or raw.storage_offset() % bits:  # whole, aligned words of ``bits`` bytes
        raw = torch.nn.functional.pad(raw, (0, (-size) % bits))
    raw = raw.view(_PACKED_WORD[bits])
    words = _scratch(workspace, "unpack_words", raw.numel(), torch.int64, packed.device).copy_(raw)
    if bits > 1:  # the widening cast extended the sign bit
        words.bitwise_and_((1 << (8 * bits)) - 1)
    shifted = _scratch(workspace, "unpack_shifted", raw.numel(), torch.int64, packed.device)
    lane, width = 64, 8 * bits
    for mask in reversed(_SWAR_MASKS[bits][:2]):
        lane, width = lane // 2, width // 2
        words.bitwise_or_(torch.bitwise_left_shift(words, lane - width, out=shifted)).bitwise_and_(mask)
    words.bitwise_or_(torch.bitwise_left_shift(words, 8 - bits, out=shifted)).bitwise_and_(
        int.from_bytes(bytes([(1 << bits) - 1] * 8), "little")
    )
    return words.view(torch.uint8)[: stop - start]


def unpack_chunks(
    packed: Tensor,
    bits: int,
    n: int,
    decode: Callable[[int, int, Tensor], object],
    workspace: Workspace | None = None,
) -> None:
    """Inverse of :func:`pack_chunks`: ``decode(start, stop, codes)`` for each chunk of the
    ``n`` codes (uint8; a workspace buffer when one is given, free to modify), so a method
    decodes chunk by chunk in cache, chunks at once on the CPU's workers
    (:func:`~grace_dgc.workspace.for_chunks`: ``decode`` writes only its own chunk)."""
    if bits not in _PACKED_WORD:
        raise ValueError(f"bits={bits!r}; unpack_chunks unpacks 1, 2 or 4 bits")
    if n and kernels.enabled(packed.device):  # one fused kernel, the whole tensor as one chunk
        codes = _scratch(workspace, "unpacked", n, torch.uint8, packed.device)
        if kernels.attempt(lambda: kernels.unpack(packed, bits, n, out=codes), packed.device) is not None:
            decode(0, n, codes)
            return
    host = packed.device.type == "cpu"

    def unpack(start: int, stop: int) -> object:
        if host:
            first = start // 8 * bits
            codes = _unpack_host(packed[first : first + packed_nbytes(stop - start, bits)], bits, stop - start)
        else:
            codes = _unpack_words(packed, bits, start, stop, workspace)
        return decode(start, stop, codes)

    for_chunks(unpack, n, packed.device, multiple=8)


def _unpack_aligned(packed: Tensor, bits: int, n: int, workspace: Workspace | None) -> Tensor:
    """:func:`unpack_bits` for bits ∈ {1, 2, 4}: ``n`` codes as uint8."""
    out = _scratch(workspace, "unpacked", n, torch.uint8, packed.device)

    def copy(start: int, stop: int, codes: Tensor) -> None:
        out[start:stop] = codes

    unpack_chunks(packed, bits, n, copy, workspace)
    return out


def _wide_layout(bits: int) -> tuple[int, int, torch.dtype]:
    """(codes, bytes, dtype) of :func:`_pack_wide`'s groups: the fewest codes that fill whole
    bytes (2 codes in 3 bytes for 12 bits, 1 in 2 for 16), and an integer type that holds a
    code shifted by up to 7 bits."""
    codes = 8 // math.gcd(bits, 8)
    return codes, bits * codes // 8, torch.int32 if bits <= 24 else torch.int64


def _wide_shift(code: int, byte: int, bits: int) -> int:
    """Where code ``code`` of a group lands in byte ``byte``: its left shift (negative: right)."""
    return code * bits - 8 * byte


def _pack_wide(codes: Tensor, bits: int) -> Tensor:
    """:func:`pack_bits` for 8 < bits ≤ 32, the same bit stream.

    A group of c codes fills exactly c·bits/8 bytes, and code j of a group starts at the fixed
    bit j·bits of it, so each output byte is an OR of shifted codes at static positions (the
    cast to uint8 keeps its low 8 bits): a few vectorised ops over the groups instead of an
    n·bits bit expansion.
    """
    n = codes.numel()
    per, width, dtype = _wide_layout(bits)
    groups = torch.nn.functional.pad(codes.reshape(-1).to(dtype), (0, (-n) % per)).view(-1, per)
    out = torch.empty(groups.shape[0], width, dtype=torch.uint8, device=codes.device)
    for byte in range(width):
        column: Tensor | None = None
        for j in range(per):
            shift = _wide_shift(j, byte, bits)
            if -bits < shift < 8:  # code j has bits in this byte
                part = groups[:, j] << shift if shift >= 0 else groups[:, j] >> -shift
                column = part if column is None else column.bitwise_or_(part)
        out[:, byte] = cast(Tensor, column)  # every byte holds some code's bits
    return out.view(-1)[: packed_nbytes(n, bits)]


def _unpack_wide(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`_pack_wide`: ``n`` codes as int64."""
    per, width, dtype = _wide_layout(bits)
    size = packed_nbytes(n, bits)
    groups = torch.nn.functional.pad(packed[:size], (0, (-size) % width)).view(-1, width).to(dtype)
    out = torch.empty(groups.shape[0], per, dtype=torch.int64, device=packed.device)
    for j in range(per):
        code: Tensor | None = None
        for byte in range(width):
            shift = -_wide_shift(j, byte, bits)  # the byte's shift into the code
            if -8 < shift < bits:
                part = groups[:, byte] << shift if shift >= 0 else groups[:, byte] >> -shift
                code = part if code is None else code.bitwise_or_(part)
        out[:, j] = cast(Tensor, code).bitwise_and_((1 << bits) - 1)
    return out.view(-1)[:n]


def pack_bits(codes: Tensor, bits: int, workspace: Workspace | None = None) -> Tensor:
    """Pack unsigned integer ``codes`` (each < 2**bits, 1 ≤ bits ≤ 32) into uint8 bytes.

    Element i occupies bits [i·bits, (i+1)·bits) of the little-endian bit stream, so
    ⌈n·bits/8⌉ bytes hold n codes (e.g. 8 one-bit codes per byte, 4 two-bit codes).
    The result is a new tensor; a :class:`~grace_dgc.workspace.Workspace` given as
    ``workspace`` holds the temporaries.

    Plain reference: ``tests/core/test_quantizers.py::reference_pack`` (each code's bits listed one
    by one, then grouped eight to a byte), equal bit for bit for every width in ``test_pack_bits_roundtrip_every_width``
    (hypothesis); the chunked forms against it in ``tests/core/test_data_path.py``.
    """
    _check_bits(bits)
    if bits > 8:
        return _pack_wide(codes, bits)
    if bits in (1, 2, 4):
        return _pack_aligned(codes, bits, workspace)
    n = codes.numel()
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)  # n·bits bits
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.uint8)
    return (stream.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.uint8) if n else stream


def unpack_bits(packed: Tensor, bits: int, n: int, workspace: Workspace | None = None) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes, as uint8 (bits ≤ 8) or int64.

    With a ``workspace`` the codes of 1, 2 and 4 bits are one of its buffers (valid until
    the next unpack with it, and free to modify); else a new tensor.
    """
    _check_bits(bits)
    if bits > 8:
        return _unpack_wide(packed, bits, n)
    if bits in (1, 2, 4):
        return _unpack_aligned(packed, bits, n, workspace)
    if bits == 8:
        return packed[:n].clone()
    shifts8 = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(1) >> shifts8) & 1).reshape(-1)[: n * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32)).to(torch.uint8)
    return (stream.reshape(n, bits) * weights).sum(dim=1, dtype=torch.uint8)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes :func:`pack_bits` produces for ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


# -- signs: the 1-bit format of the sign family (signsgd, signum, efsignsgd, onebit) -----


def pack_signs(tensor: Tensor, workspace: Workspace | None = None) -> Tensor:
    """Bit i = 1 where ``tensor_i ≥ 0``, else 0, packed by :func:`pack_bits` (8 per byte).

    One bit cannot say 0, so an exact zero travels as +1 (as in GRACE).
    """
    flat = tensor.reshape(-1)
    fused = kernels.attempt(lambda: kernels.pack_signs(flat), flat.device, flat.dtype) if flat.numel() else None
    if fused is not None:  # x ≥ 0 and the packing in one pass
        return fused

    def encode(start: int, stop: int) -> Tensor:
        return compare("ge", flat[start:stop], 0, _scratch(workspace, "signs", stop - start, torch.bool, flat.device))

    return pack_chunks(flat.numel(), 1, encode, flat.device, workspace)


def _float_bits(value: float | Tensor) -> int | Tensor:
    """The fp32 bit pattern of ``value`` as a signed 32-bit Python int; of a one-element tensor,
    as a 0-dim int32 tensor on its device (read there, never on the host)."""
    if isinstance(value, Tensor):
        return value.reshape(()).to(torch.float32).view(torch.int32)
    return struct.unpack("<i", struct.pack("<f", float(value)))[0]


def unpack_select(
    packed: Tensor, out: Tensor, if_set: float | Tensor, if_clear: float | Tensor, workspace: Workspace | None = None
) -> Tensor:
    """``out_i = if_set`` where bit i of the :func:`pack_bits` stream is 1, else ``if_clear``
    (two fp32 values, or one-element tensors on ``out``'s device: onebit's means, read there
    without a host sync), written into ``out`` and returned: the decoder of the sign methods.

    It selects on fp32 bits, ``word = (−bit & (set ⊕ clear)) ⊕ clear``, in three integer
    passes: several times faster on a CPU than ``torch.where`` or ``masked_fill_`` with a
    bool mask, and exact (each element is one of the two values, cast to ``out``'s dtype).
    """
    if lookup_fused(packed, 1, out, [if_clear, if_set], workspace):
        return out
    n = out.numel()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    target = out if direct else _scratch(workspace, "select", n, torch.float32, out.device)
    words = target.view(-1).view(torch.int32)
    set_bits, clear_bits = _float_bits(if_set), _float_bits(if_clear)

    def select(start: int, stop: int, bits: Tensor) -> None:
        word = words[start:stop].copy_(bits)
        word.neg_().bitwise_and_(set_bits ^ clear_bits).bitwise_xor_(clear_bits)

    unpack_chunks(packed, 1, n, select, workspace)
    return out if direct else out.copy_(target.view(out.shape))


def lookup_bytes(packed: Tensor, bits: int, values: Tensor, out: Tensor, workspace: Workspace | None = None) -> bool:
    """``out_i = values[code_i]`` for the ``bits``-bit codes of ``packed`` (1, 2, 4 or 8), on a CPU
    into a contiguous fp32 ``out``: a byte holds 8/bits codes, so one lookup in a 256-row table
    writes all of their values (a row gather per byte, no codes unpacked, no byte arithmetic:
    torch's 8-bit ops are slow on a CPU). True when done; False where it does not apply (another
    device or dtype), and the caller decodes its own way."""
    if out.device.type != "cpu" or out.dtype != torch.float32 or not out.is_contiguous() or bits not in (1, 2, 4, 8):
        return False
    per, n, flat, values = 8 // bits, out.numel(), out.view(-1), values.to(torch.float32)
    byte = torch.arange(256)
    table = values[torch.stack([(byte >> (i * bits)) & ((1 << bits) - 1) for i in range(per)], 1)]
    whole = n // per
    rows = flat[: whole * per].view(whole, per)

    def decode(start: int, stop: int) -> None:
        index = _scratch(workspace, "index", stop - start, torch.int64, "cpu").copy_(packed[start:stop])
        torch.index_select(table, 0, index, out=rows[start:stop])

    for_chunks(decode, whole, "cpu")
    if n > whole * per:  # the last byte's codes
        flat[whole * per :] = values[unpack_bits(packed[whole:], bits, n - whole * per).long()]
    return True


def lookup_fused(
    packed: Tensor, bits: int, out: Tensor, table: Sequence[float | Tensor], workspace: Workspace | None = None
) -> bool:
    """``out_i = table[code_i]`` for the 1- or 2-bit codes of ``packed`` by the fused kernel
    (:func:`grace_dgc.kernels.unpack_lookup`, through an fp32 scratch for another dtype), when
    it runs on ``out``'s device: True; else False, and the caller decodes with torch ops."""
    n = out.numel()
    kernel = "lookup_table" if any(isinstance(v, Tensor) for v in table) else None  # the table read on the device
    if not n or not kernels.enabled(out.device, kernel=kernel):
        return False
    direct = out.dtype == torch.float32 and out.is_contiguous()
    target = out if direct else _scratch(workspace, "select", n, torch.float32, out.device)

    def launch() -> Tensor:
        return kernels.unpack_lookup(packed, bits, target.view(-1), table)

    if kernels.attempt(launch, out.device, kernel=kernel) is None:
        return False  # a kernel failed (warned): the caller's torch path
    if not direct:
        out.copy_(target.view(out.shape))
    return True
