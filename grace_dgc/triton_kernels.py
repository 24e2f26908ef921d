"""The Triton kernels of :mod:`grace_dgc.kernels` (which documents them and is their only
caller). Imported on first use, never by ``import grace_dgc``: Triton chooses between compiling
and its interpreter (``TRITON_INTERPRET=1``) when this module is imported."""

# mypy: disable-error-code="no-untyped-def"
# (a kernel's parameters are untyped: Triton reads their annotations, tl.constexpr, itself)
#
# Offsets are int64 (program id × block), and a packed byte b is written iff its first code
# exists (b·PER < n, in int64): an n·bits product in 32 bits would wrap from n ≈ 5·10⁸.

import triton
import triton.language as tl


@triton.jit
def pack_kernel(
    source, out, n, threshold, BITS: tl.constexpr, PER: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, PER)
    index = rows[:, None] * PER + lanes[None, :]
    if MODE == 1:  # SIGNS: x ≥ 0 (NaN: 0; −0.0: 1), as torch.ge
        code = (tl.load(source + index, mask=index < n, other=-1.0) >= 0).to(tl.int32)
    elif MODE == 2:  # TERNARY: 3 where x ≥ τ, 2 where x ≤ −τ, else 0 (τ > 0, so one at most)
        x = tl.load(source + index, mask=index < n, other=0.0).to(tl.float32)
        code = tl.where(x >= threshold, 3, tl.where(x <= -threshold, 2, 0))
    else:  # CODES, one per byte
        code = tl.load(source + index, mask=index < n, other=0).to(tl.int32)
    byte = tl.sum(code << (lanes[None, :] * BITS), axis=1)  # disjoint bits: the sum is an OR
    tl.store(out + rows, byte.to(tl.uint8), mask=rows * PER < n)


@triton.jit
def unpack_kernel(packed, out, n, BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, PER)
    byte = tl.load(packed + rows, mask=rows * PER < n, other=0).to(tl.int32)
    code = (byte[:, None] >> (lanes[None, :] * BITS)) & ((1 << BITS) - 1)
    index = rows[:, None] * PER + lanes[None, :]
    tl.store(out + index, code.to(tl.uint8), mask=index < n)


@triton.jit(do_not_specialize=["v0", "v1", "v2", "v3"])  # new values each step: no recompiling
def lookup_kernel(packed, out, n, v0, v1, v2, v3, BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, PER)
    byte = tl.load(packed + rows, mask=rows * PER < n, other=0).to(tl.int32)
    code = (byte[:, None] >> (lanes[None, :] * BITS)) & ((1 << BITS) - 1)
    # fp32 bit patterns (int32), so a −0.0 in the table stays −0.0
    value = tl.where(code == 0, v0, tl.where(code == 1, v1, tl.where(code == 2, v2, v3))).to(tl.int32)
    index = rows[:, None] * PER + lanes[None, :]
    tl.store(out + index, value, mask=index < n)


@triton.jit
def hits(source, n, threshold, KEEP_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """(index, |x|, hit) of one block: |x| ≥ τ, a NaN counting as a hit with KEEP_NAN."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < n
    magnitude = tl.abs(tl.load(source + index, mask=inside, other=0.0))
    wide = magnitude.to(tl.float32)  # exact; τ was rounded to the input's dtype, as torch compares
    if KEEP_NAN:
        hit = ~(wide < threshold)
    else:
        hit = wide >= threshold
    return index, magnitude, hit & inside


@triton.jit
def count_kernel(source, counts, n, threshold, KEEP_NAN: tl.constexpr, BLOCK: tl.constexpr):
    _, _, hit = hits(source, n, threshold, KEEP_NAN, BLOCK)
    tl.store(counts + tl.program_id(0), tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def compact_kernel(source, starts, indices, magnitudes, n, threshold, KEEP_NAN: tl.constexpr, BLOCK: tl.constexpr):
    index, magnitude, hit = hits(source, n, threshold, KEEP_NAN, BLOCK)
    flag = hit.to(tl.int32)
    slot = tl.load(starts + tl.program_id(0)) + tl.cumsum(flag, axis=0) - flag  # ascending, as nonzero
    tl.store(indices + slot, index, mask=hit)
    tl.store(magnitudes + slot, magnitude, mask=hit)


@triton.jit
def sign_split_kernel(source, source_bits, packed, picked, counts, n, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, 8)
    index = rows[:, None] * 8 + lanes[None, :]
    inside = index < n
    positive = tl.load(source + index, mask=inside, other=-1.0) >= 0  # NaN: negative, as torch.ge
    raw = tl.load(source_bits + index, mask=inside, other=0)
    tl.store(picked + index, tl.where(positive, raw, 0), mask=inside)
    code = positive.to(tl.int32)
    tl.store(packed + rows, tl.sum(code << lanes[None, :], axis=1).to(tl.uint8), mask=rows * 8 < n)
    tl.store(counts + tl.program_id(0), tl.sum(tl.sum(code, axis=1), axis=0))
