"""Wire format: how a payload (a list of tensors) becomes bytes and back.

A payload travels as one flat ``uint8`` buffer (the tensors' raw bytes, concatenated)
plus a header of per-tensor byte lengths (int64). Receivers rebuild each tensor with the
dtype and trailing shape of their own payload in the same position: every rank runs the
same compressor, so only the leading dimension may differ between ranks.
"""
import numbers

import torch


def as_bytes(tensor):
    """The raw bytes of ``tensor`` as a 1-D uint8 view (a copy only if not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def encode(payload):
    """``payload -> (buffer, header)``: uint8 buffer and int64 per-tensor byte lengths."""
    chunks = [as_bytes(t) for t in payload]
    device = payload[0].device
    header = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
    buffer = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    return buffer, header


def decode(buffer, header, template):
    """Inverse of :func:`encode`, shaped like ``template`` (this rank's own payload)."""
    lengths = header.tolist()
    out, start = [], 0
    for length, like in zip(lengths, template):
        raw = buffer[start:start + length]
        if (raw.storage_offset() % like.element_size()) != 0:
            raw = raw.clone()   # a view as a wider dtype needs an aligned offset
        start += length
        values = raw.view(like.dtype)
        out.append(values.reshape(like.shape) if like.dim() == 0
                   else values.reshape(-1, *like.shape[1:]))
    return out


def nbytes(payload):
    """Bytes of a payload as it sits in memory (no header)."""
    return sum(t.numel() * t.element_size() for t in payload)


# -- bit packing: the one implementation every packed method uses ------------------------

MAX_BITS = 32


def _check_bits(bits):
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits!r} is out of range; accepted: integers 1..{MAX_BITS}")


def _pack_aligned(codes, bits):
    """:func:`pack_bits` for bits ∈ {1, 2, 4}, the same bit stream: 8/bits codes per byte,
    code j of a byte at bits [j·bits, (j+1)·bits), OR-ed column by column (no bit expansion)."""
    per_byte = 8 // bits
    n = codes.numel()
    columns = torch.nn.functional.pad(codes.reshape(-1).to(torch.uint8), (0, (-n) % per_byte))
    columns = columns.view(-1, per_byte)
    packed = columns[:, 0].clone()
    for j in range(1, per_byte):
        packed |= columns[:, j] << (j * bits)
    return packed


def _unpack_aligned(packed, bits, n):
    """Inverse of :func:`_pack_aligned`: ``n`` codes as uint8."""
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    return ((packed[: packed_nbytes(n, bits)].unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


def _pack_wide(codes, bits):
    """:func:`pack_bits` for 8 < bits ≤ 32, the same bit stream.

    Eight codes fill exactly ``bits`` bytes, and code j of a group starts at the fixed bit
    j·bits of it, so each output byte is an OR of shifted code slices at static
    positions: ≤ 8·5 vectorised ops over the groups instead of an n·bits bit expansion.
    """
    n = codes.numel()
    groups = torch.nn.functional.pad(codes.reshape(-1).to(torch.int64), (0, (-n) % 8)).reshape(-1, 8)
    columns = [None] * bits
    for j in range(8):
        start = j * bits
        for byte in range(start // 8, (start + bits - 1) // 8 + 1):
            part = ((groups[:, j] << (start % 8)) >> (8 * (byte - start // 8))) & 0xFF
            columns[byte] = part if columns[byte] is None else columns[byte] | part
    return torch.stack(columns, dim=1).to(torch.uint8).reshape(-1)[: packed_nbytes(n, bits)]


def _unpack_wide(packed, bits, n):
    """Inverse of :func:`_pack_wide`: ``n`` codes as int64."""
    size = packed_nbytes(n, bits)
    groups = torch.nn.functional.pad(packed[:size], (0, (-size) % bits)).to(torch.int64).reshape(-1, bits)
    codes = []
    for j in range(8):
        start = j * bits
        window = 0      # the bytes code j touches, little-endian
        for byte in range(start // 8, (start + bits - 1) // 8 + 1):
            window = window | (groups[:, byte] << (8 * (byte - start // 8)))
        codes.append((window >> (start % 8)) & ((1 << bits) - 1))
    return torch.stack(codes, dim=1).reshape(-1)[:n]


def pack_bits(codes, bits):
    """Pack unsigned integer ``codes`` (each < 2**bits, 1 ≤ bits ≤ 32) into uint8 bytes.

    Element i occupies bits [i·bits, (i+1)·bits) of the little-endian bit stream, so
    ⌈n·bits/8⌉ bytes hold n codes (e.g. 8 one-bit codes per byte, 4 two-bit codes).
    """
    _check_bits(bits)
    if bits > 8:
        return _pack_wide(codes, bits)
    if bits in (1, 2, 4):
        return _pack_aligned(codes, bits)
    n = codes.numel()
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)           # n·bits bits
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.uint8)
    return (stream.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.uint8) if n else stream


def unpack_bits(packed, bits, n):
    """Inverse of :func:`pack_bits`: the first ``n`` codes, as uint8 (bits ≤ 8) or int64."""
    _check_bits(bits)
    if bits > 8:
        return _unpack_wide(packed, bits, n)
    if bits in (1, 2, 4):
        return _unpack_aligned(packed, bits, n)
    if bits == 8:
        return packed[:n].clone()
    shifts8 = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(1) >> shifts8) & 1).reshape(-1)[: n * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32)).to(torch.uint8)
    return (stream.reshape(n, bits) * weights).sum(dim=1, dtype=torch.uint8)


def packed_nbytes(n, bits):
    """Bytes :func:`pack_bits` produces for ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


# -- signs: the 1-bit format of the sign family (signsgd, signum, efsignsgd, onebit) -----

def pack_signs(tensor):
    """Bit i = 1 where ``tensor_i ≥ 0``, else 0, packed by :func:`pack_bits` (8 per byte).

    One bit cannot say 0, so an exact zero travels as +1 (as in GRACE).
    """
    return pack_bits(tensor.reshape(-1) >= 0, 1)


def unpack_signs(packed, n, dtype=torch.float32):
    """Inverse of :func:`pack_signs`: ``n`` values of ±1 in ``dtype`` (1-D)."""
    return unpack_bits(packed, 1, n).to(dtype) * 2 - 1
