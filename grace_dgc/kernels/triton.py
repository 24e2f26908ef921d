"""The Triton kernels of :mod:`grace_dgc.kernels` (which documents them and is their only
caller). Imported on first use, never by ``import grace_dgc``: Triton chooses between compiling
and its interpreter (``TRITON_INTERPRET=1``) when this module is imported."""

# mypy: disable-error-code="no-untyped-def"
# (a kernel's parameters are untyped: Triton reads their annotations, tl.constexpr, itself)
#
# Offsets are int64 (program id × block), and a packed byte b is written iff its first code
# exists (b·PER < n, in int64): an n·bits product in 32 bits would wrap from n ≈ 5·10⁸.
#
# Floats are read as their bit patterns (int16 for fp16/bf16, int32 for fp32) and compared as
# integers: for IEEE floats, |x|'s bits (the sign bit cleared) order like |x|, infinity is the
# largest finite-or-infinite pattern (INF) and a NaN's is above it. So x ≥ 0, |x| ≥ τ and twobit's
# x ≥ τ / x ≤ −τ are exact whatever a backend does with subnormals (Triton's interpreter
# flushes bf16 subnormals to zero when it widens them; a GPU may flush in compares).

import triton
import triton.language as tl


@triton.jit
def signs_of(raw, ABS: tl.constexpr, INF: tl.constexpr):
    """x ≥ 0 from x's bits: not NaN, and the sign bit clear or x = ±0 (−0.0 ≥ 0, as torch.ge)."""
    magnitude = raw & ABS
    return (magnitude <= INF) & ((raw >= 0) | (magnitude == 0))


@triton.jit
def pack_kernel(
    source,
    out,
    n,
    tau_bits,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    MODE: tl.constexpr,
    ABS: tl.constexpr,
    INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, PER)
    index = rows[:, None] * PER + lanes[None, :]
    if MODE == 1:  # SIGNS: x ≥ 0 (NaN: 0; −0.0: 1), as torch.ge
        code = signs_of(tl.load(source + index, mask=index < n, other=-1), ABS, INF).to(tl.int32)
    elif MODE == 2:  # TERNARY: 3 where x ≥ τ, 2 where x ≤ −τ, else 0 (x ≥ τ tested first, as twobit)
        raw = tl.load(source + index, mask=index < n, other=0)
        magnitude = raw & ABS
        finite_or_inf = magnitude <= INF
        at_least = magnitude >= tau_bits
        up = finite_or_inf & (((raw >= 0) & at_least) | ((magnitude == 0) & (tau_bits == 0)))
        down = finite_or_inf & (raw < 0) & at_least
        code = tl.where(up, 3, tl.where(down, 2, 0))
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
def lookup_table_kernel(packed, out, n, table, BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr):
    """lookup_kernel with the table's fp32 bit patterns read from device memory (values a
    compressor computed there, such as onebit's means: no host read)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, PER)
    byte = tl.load(packed + rows, mask=rows * PER < n, other=0).to(tl.int32)
    code = (byte[:, None] >> (lanes[None, :] * BITS)) & ((1 << BITS) - 1)
    index = rows[:, None] * PER + lanes[None, :]
    tl.store(out + index, tl.load(table + code), mask=index < n)


@triton.jit
def hits(source, n, tau_bits, KEEP_NAN: tl.constexpr, ABS: tl.constexpr, INF: tl.constexpr, BLOCK: tl.constexpr):
    """(index, |x|'s bits, hit) of one block: |x| ≥ τ, a NaN a hit with KEEP_NAN (as ~(|x| < τ))."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < n
    magnitude = tl.load(source + index, mask=inside, other=0) & ABS
    if KEEP_NAN:
        hit = magnitude >= tau_bits  # a NaN's bits are above every τ's
    else:
        hit = (magnitude >= tau_bits) & (magnitude <= INF)
    return index, magnitude, hit & inside


@triton.jit
def count_kernel(
    source, counts, n, tau_bits, KEEP_NAN: tl.constexpr, ABS: tl.constexpr, INF: tl.constexpr, BLOCK: tl.constexpr
):
    _, _, hit = hits(source, n, tau_bits, KEEP_NAN, ABS, INF, BLOCK)
    tl.store(counts + tl.program_id(0), tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def compact_kernel(
    source,
    starts,
    indices,
    magnitudes,
    n,
    tau_bits,
    KEEP_NAN: tl.constexpr,
    ABS: tl.constexpr,
    INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, magnitude, hit = hits(source, n, tau_bits, KEEP_NAN, ABS, INF, BLOCK)
    flag = hit.to(tl.int32)
    slot = tl.load(starts + tl.program_id(0)) + tl.cumsum(flag, axis=0) - flag  # ascending, as nonzero
    tl.store(indices + slot, index, mask=hit)
    tl.store(magnitudes + slot, magnitude, mask=hit)  # |x| as torch.abs: the sign bit cleared


@triton.jit
def sign_split_kernel(source_bits, packed, picked, counts, n, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, 8)
    index = rows[:, None] * 8 + lanes[None, :]
    inside = index < n
    raw = tl.load(source_bits + index, mask=inside, other=-1)
    positive = signs_of(raw, 0x7FFFFFFF, 0x7F800000) & inside  # fp32; NaN: negative, as torch.ge
    tl.store(picked + index, tl.where(positive, raw, 0), mask=inside)
    code = positive.to(tl.int32)
    tl.store(packed + rows, tl.sum(code << lanes[None, :], axis=1).to(tl.uint8), mask=rows * 8 < n)
    tl.store(counts + tl.program_id(0), tl.sum(tl.sum(code, axis=1), axis=0))


# -- THC's Walsh–Hadamard transform (kernels.rotate, kernels.unrotate) --------------------------
#
# A butterfly stage on bit k pairs the elements i and i + 2^k (bit k of i clear) and writes a + b
# to i, a − b to i + 2^k, in fp32: what thc.hadamard's torch ops compute, one stage per pass over
# memory. Here a program holds a tile in registers and runs several stages on it, bits ascending,
# the same two operations on the same operands in the same order: the same bits. The stages run
# in "constant geometry": each pairs neighbours 2i, 2i + 1 (their lowest index bit), writes the
# sum to i and the difference to i + half, which rotates the index bits right by one, so the next
# stage's neighbours differ in the next bit; after log2(rows) stages the rows are in their natural
# order again. A stage that is not live (a tensor shorter than the tile) passes a and b through
# unchanged, so padding beyond d never mixes in. Multiplications are rounded on their own (the
# launches pass enable_fp_fusion=False): an FMA would round codes·factor + b once, not twice.


@triton.jit
def stage_rows(x, ROWS: tl.constexpr, WIDTH: tl.constexpr, live):
    """One constant-geometry butterfly stage along axis 0 of a [ROWS, WIDTH] tile (``live``:
    a + b and a − b; else a and b moved as they are)."""
    a, b = tl.split(tl.permute(tl.reshape(x, [ROWS // 2, 2, WIDTH]), (0, 2, 1)))
    pair = tl.join(tl.where(live, a + b, a), tl.where(live, a - b, b))  # [ROWS // 2, WIDTH, 2]
    return tl.reshape(tl.permute(pair, (2, 0, 1)), [ROWS, WIDTH])


@triton.jit
def hadamard_block_kernel(
    source,
    signs,
    factor,
    out,
    n,
    d,
    live,
    scale,
    CODES: tl.constexpr,
    LAST: tl.constexpr,
    LOG: tl.constexpr,
):
    """The first min(LOG, log2 d) stages (bits 0, 1, …) within each block of 2^LOG elements, read
    from ``source``: values (n of them, zero-padded to d, times the signs: thc's D·x) or, with
    CODES, d integer codes times the 0-d fp32 ``factor`` (thc's decoder). LAST 0: the block's
    d elements into ``out``; 1: times ``scale`` (1/√d in fp32), into ``out``; 2: times ``scale``
    and then the signs, the first n into ``out``."""
    BLOCK: tl.constexpr = 1 << LOG
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if CODES:
        x = tl.load(source + index, mask=index < d, other=0).to(tl.float32) * tl.load(factor)
    else:
        x = tl.load(source + index, mask=index < n, other=0.0) * tl.load(signs + index, mask=index < d, other=1.0)
    x = tl.reshape(x, [BLOCK, 1])
    for k in tl.static_range(LOG):
        x = stage_rows(x, BLOCK, 1, k < live)
    x = tl.reshape(x, [BLOCK])
    if LAST == 0:
        tl.store(out + index, x, mask=index < d)
    elif LAST == 1:
        tl.store(out + index, x * scale, mask=index < d)
    else:
        tl.store(out + index, x * scale * tl.load(signs + index, mask=index < n, other=1.0), mask=index < n)


@triton.jit
def hadamard_columns_kernel(
    work, signs, out, n, inner, scale, LOG: tl.constexpr, WIDTH: tl.constexpr, LAST: tl.constexpr
):
    """The next LOG stages, bits log2(inner) … log2(inner) + LOG − 1, in place in ``work`` seen
    as [outer, 2^LOG, inner]: each program a tile of 2^LOG rows (stride ``inner``) by WIDTH
    contiguous columns. LAST as hadamard_block_kernel's (2: into ``out``, not ``work``)."""
    ROWS: tl.constexpr = 1 << LOG
    program = tl.program_id(0).to(tl.int64)
    inner = inner.to(tl.int64)
    tiles = inner // WIDTH  # per row of the outer axis
    start = (program // tiles) * (inner * ROWS) + (program % tiles) * WIDTH
    index = start + tl.arange(0, ROWS)[:, None] * inner + tl.arange(0, WIDTH)[None, :]
    x = tl.load(work + index)
    for _ in tl.static_range(LOG):
        x = stage_rows(x, ROWS, WIDTH, True)
    if LAST == 0:
        tl.store(work + index, x)
    elif LAST == 1:
        tl.store(work + index, x * scale)
    else:
        tl.store(out + index, x * scale * tl.load(signs + index, mask=index < n, other=1.0), mask=index < n)


@triton.jit
def stochastic_codes_kernel(values, uniform, factor, codes, n, levels, BLOCK: tl.constexpr):
    """THC's quantizer in one pass: u = x·factor, NaN → 0, clamped to [−K, K] (±∞ → ±K), then
    ⌊u⌋ + (uniform < u − ⌊u⌋) in fp32, stored as the codes' integer type (thc's torch ops).
    ⌊u⌋ from u truncated to an integer, less one where that is above u: exact for |u| ≤ K, a
    subnormal u included (tl.floor compiles to a floor that flushes subnormals to zero; only
    ⌊−0.0⌋'s sign differs, +0, which changes no code)."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < n
    u = tl.load(values + index, mask=inside, other=0.0) * tl.load(factor)
    u = tl.minimum(tl.maximum(tl.where(u != u, 0.0, u), -levels), levels)
    low = u.to(tl.int32).to(tl.float32)
    low = tl.where(low > u, low - 1.0, low)
    up = tl.load(uniform + index, mask=inside, other=1.0) < u - low
    tl.store(codes + index, (low + up.to(tl.float32)).to(codes.dtype.element_ty), mask=inside)


# -- QSGD's quantizer and its decoder (kernels.qsgd_codes, kernels.qsgd_values) -----------------
#
# Element i is in bucket i // size (a zero-padded [rows, size] block, read up to n): each program
# divides once in int64 for its first element's bucket, then each element its offset within
# (< size + BLOCK) by size. The per-bucket factors (s/‖v‖, ‖v‖/s) are torch's, computed
# before the launch, so a kernel multiplies by exactly the fp32 numbers the torch ops multiply
# by; launched with enable_fp_fusion=False, each product rounded on its own.


@triton.jit
def bucket_of(BLOCK: tl.constexpr, n, size):
    """(index, inside, bucket) of this program's BLOCK elements."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    first = start // size
    index = start + tl.arange(0, BLOCK)
    local = (start - first * size) + tl.arange(0, BLOCK)
    return index, index < n, first + local // size


@triton.jit
def qsgd_codes_kernel(values, uniform, factor, codes, n, size, levels, BLOCK: tl.constexpr):
    """QSGD's quantizer in one pass (qsgd's abs, mul, clamp, floor, sub, lt, add, copysign,
    add, cast): u = |x|·factor[bucket], clamped to s (NaN stays NaN), ξ = ⌊u⌋ + (uniform <
    u − ⌊u⌋), code = s ± ξ by x's sign bit (copysign), a NaN u's code 0 (the torch cast of NaN
    to uint8; to int64 its INT64_MIN packs to the same bits). ⌊u⌋ from u truncated to an
    integer (exact for 0 ≤ u ≤ s ≤ 2^23, a subnormal u included: tl.floor flushes them)."""
    index, inside, bucket = bucket_of(BLOCK, n, size)
    x = tl.load(values + index, mask=inside, other=0.0)
    u = tl.abs(x) * tl.load(factor + bucket, mask=inside, other=0.0)
    u = tl.where(u > levels, levels, u)  # clamp_(max=s): a NaN compares false and stays
    nan = u != u
    u = tl.where(nan, 0.0, u)
    low = u.to(tl.int32).to(tl.float32)
    level = low + (tl.load(uniform + index, mask=inside, other=1.0) < u - low).to(tl.float32)
    signed = tl.where(x.to(tl.int32, bitcast=True) < 0, -level, level) + levels  # exact integers
    code = tl.where(nan, 0, signed.to(tl.int32))
    tl.store(codes + index, code.to(codes.dtype.element_ty), mask=inside)


@triton.jit
def qsgd_values_kernel(codes, scale, out, n, size, levels, BLOCK: tl.constexpr):
    """QSGD's decoder in one pass (qsgd's cast, sub, mul): out = (code − s)·scale[bucket] in
    fp32, scale = ‖v‖/s per bucket."""
    index, inside, bucket = bucket_of(BLOCK, n, size)
    code = tl.load(codes + index, mask=inside, other=0).to(tl.float32)
    tl.store(out + index, (code - levels) * tl.load(scale + bucket, mask=inside, other=0.0), mask=inside)


@triton.jit
def mix(v, key, m32):
    """random-k's round function F(v, K) (grace_dgc.compressors.randomk._hash, op for op)."""
    h = v ^ key
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & m32
    return h ^ (h >> 16)


@triton.jit
def feistel_round(x, a, b, mask_a, mask_b, key, m32):
    """x = A·2^b + B ↦ B·2^a + (A ⊕ (F(B, K) mod 2^a))."""
    low = x & mask_b
    return (low << a) | ((x >> b) ^ (mix(low, key, m32) & mask_a))


@triton.jit
def permute(x, a, b, mask_a, mask_b, k0, k1, k2, k3, k4, k5, m32):
    """random-k's π: six rounds, the halves' widths swapping each round."""
    x = feistel_round(x, a, b, mask_a, mask_b, k0, m32)
    x = feistel_round(x, b, a, mask_b, mask_a, k1, m32)
    x = feistel_round(x, a, b, mask_a, mask_b, k2, m32)
    x = feistel_round(x, b, a, mask_b, mask_a, k3, m32)
    x = feistel_round(x, a, b, mask_a, mask_b, k4, m32)
    return feistel_round(x, b, a, mask_b, mask_a, k5, m32)


@triton.jit(do_not_specialize=["k", "n", "k0", "k1", "k2", "k3", "k4", "k5"])  # new keys each step
def random_indices_kernel(out, k, n, a, b, mask_a, mask_b, k0, k1, k2, k3, k4, k5, m32, BLOCK: tl.constexpr):
    """out[i] = π(i) walked into range(n), for i < k: distinct indices, no generator."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < k
    x = permute(index, a, b, mask_a, mask_b, k0, k1, k2, k3, k4, k5, m32)
    walking = inside & (x >= n)
    while tl.max(walking.to(tl.int32), axis=0) > 0:  # the domain is < 2n: a few walks at most
        x = tl.where(walking, permute(x, a, b, mask_a, mask_b, k0, k1, k2, k3, k4, k5, m32), x)
        walking = inside & (x >= n)
    tl.store(out + index, x, mask=inside)


@triton.jit
def fp8_code(y, MANT: tl.constexpr, BIAS: tl.constexpr, SATURATE: tl.constexpr):
    """The fp8 code (e4m3fn: MANT 3, BIAS 7; e5m2: 2, 15) of fp32 ``y``, rounded to nearest
    even from y's bits, as torch casts: e4m3fn saturates to ±448 (it has no infinity), e5m2
    overflows to ±inf; NaN → 0x7F with y's sign bit."""
    raw = y.to(tl.int32, bitcast=True)
    sign = (raw >> 31) & 1
    field = (raw >> 23) & 0xFF
    mantissa = raw & 0x7FFFFF
    exponent = field - 127
    normal = exponent >= 1 - BIAS
    shift = tl.minimum(tl.where(normal, 23 - MANT, 24 - MANT - BIAS - exponent), 25)  # 25 on: all bits gone
    whole = mantissa | 0x800000
    kept = whole >> shift
    rest = whole & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    code = tl.where(normal, ((exponent + BIAS) << MANT) + kept - (1 << MANT), kept)
    code = tl.where(field == 0, 0, code)  # ±0 and fp32's subnormals
    code = tl.minimum(code, 0x7E if SATURATE else 0x7C)
    code = tl.where((field == 0xFF) & (mantissa != 0), 0x7F, code)
    return code | (sign << 7)


@triton.jit
def fp8_encode_kernel(
    values,
    codes,
    scales,
    n,
    blocks,
    size,
    largest,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    SATURATE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """fp8's compress over ROWS blocks of ``size``: s_b = max|x|/F (1 for a zero or NaN block),
    codes = fp8(x / s_b), in one read of x."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    column = tl.arange(0, COLS)
    index = row[:, None] * size + column[None, :]
    inside = (column[None, :] < size) & (index < n)
    x = tl.load(values + index, mask=inside, other=0.0)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = tl.div_rn(tl.max(tl.abs(x), axis=1), largest)
    scale = tl.where(has_nan | (scale <= 0), 1.0, scale)  # torch: NaN > 0 is false
    code = fp8_code(tl.div_rn(x, scale[:, None]), MANT, BIAS, SATURATE)
    tl.store(codes + index, code.to(tl.uint8), mask=inside)
    tl.store(scales + row, scale, mask=row < blocks)


@triton.jit
def fp8_decode_kernel(codes, scales, table, out, n, blocks, size, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp8's decompress: out = s_b · fp32(code), the code's value from a 256-entry table."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    column = tl.arange(0, COLS)
    index = row[:, None] * size + column[None, :]
    inside = (column[None, :] < size) & (index < n)
    code = tl.load(codes + index, mask=inside, other=0).to(tl.int32)
    value = tl.load(table + code, mask=inside, other=0.0)
    scale = tl.load(scales + row, mask=row < blocks, other=1.0)
    tl.store(out + index, value * scale[:, None], mask=inside)


@triton.jit
def fp4_code(x, s):
    """fp4's E3M0 code of fp32 ``x`` under the power-of-two scale ``s``, as its torch ops give it:
    y = |x|/s rounded once; for a normal y the nearest field is E_y − 120 + (M_y ≥ 2^22) (frexp's
    exponent + 6, + 1 from mantissa 0.75 up); below field 1 (or y = 0) it is 1 if |x| ≥ s·2^−7,
    else 0; a non-finite y is 7; the sign is bit 3. The tests on y and |x| are on their bits."""
    raw = x.to(tl.int32, bitcast=True)
    magnitude = tl.abs(x)
    y = tl.div_rn(magnitude, s).to(tl.int32, bitcast=True)
    exponent = (y >> 23) & 0xFF
    field = exponent - 120 + ((y & 0x7FFFFF) >= 0x400000).to(tl.int32)
    threshold = (s * 0.0078125).to(tl.int32, bitcast=True)
    above = (magnitude.to(tl.int32, bitcast=True) >= threshold).to(tl.int32)
    field = tl.where((field < 1) | (y == 0), above, field)
    field = tl.minimum(tl.maximum(field, 0), 7)
    field = tl.where(exponent == 255, 7, field)
    return field + (raw < 0).to(tl.int32) * 8


@triton.jit
def fp4_encode_kernel(values, scale, packed, n, BLOCK: tl.constexpr):
    """fp4's compress: byte b = code(x_2b) | code(x_2b+1) << 4 (a missing last code: 0), one read
    of x, s read from the device (no host sync)."""
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(scale)
    low = tl.load(values + 2 * byte, mask=2 * byte < n, other=0.0)
    high = tl.load(values + 2 * byte + 1, mask=2 * byte + 1 < n, other=0.0)
    code = fp4_code(low, s) | (fp4_code(high, s) << 4)
    tl.store(packed + byte, code.to(tl.uint8), mask=2 * byte < n)


@triton.jit
def fp4_value(code, s):
    """±s·2^(e−7) of a 4-bit code (e = 0: ±0), the power of two built from its bits and the
    sign set as a bit (a float negation may be 0 − v, which gives +0 for −0)."""
    field = code & 7
    power = ((field + 120) << 23).to(tl.float32, bitcast=True)
    value = tl.where(field > 0, power * s, 0.0).to(tl.int32, bitcast=True)
    return (value | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def fp4_decode_kernel(packed, scale, out, n, BLOCK: tl.constexpr):
    """fp4's decompress into fp32 ``out``: both codes of each byte."""
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(scale)
    code = tl.load(packed + byte, mask=2 * byte < n, other=0).to(tl.int32)
    tl.store(out + 2 * byte, fp4_value(code & 15, s), mask=2 * byte < n)
    tl.store(out + 2 * byte + 1, fp4_value(code >> 4, s), mask=2 * byte + 1 < n)


@triton.jit
def terngrad_encode_kernel(values, uniform, bound, divisor, packed, n, BLOCK: tl.constexpr):
    """terngrad's compress: ĝ = clamp(x, −b, b), code = 1 + (ĝ's sign bit) where u < |ĝ|/s (u − p's
    sign bit, as its torch ops test it; a NaN's p is 0), else 0; four 2-bit codes per byte. b and
    s are read from the device (no host sync)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, 4)
    index = rows[:, None] * 4 + lanes[None, :]
    inside = index < n
    x = tl.load(values + index, mask=inside, other=0.0)
    b, s = tl.load(bound), tl.load(divisor)
    clipped = tl.where(x > b, b, tl.where(x < -b, -b, x))
    probability = tl.div_rn(tl.abs(clipped), s)
    probability = tl.where(probability != probability, 0.0, probability)
    difference = tl.load(uniform + index, mask=inside, other=1.0) - probability
    sent = difference.to(tl.int32, bitcast=True) < 0
    code = tl.where(sent, 1 + (clipped.to(tl.int32, bitcast=True) < 0).to(tl.int32), 0)
    byte = tl.sum(code << (lanes[None, :] * 2), axis=1)  # disjoint bits: the sum is an OR
    tl.store(packed + rows, byte.to(tl.uint8), mask=rows * 4 < n)


@triton.jit
def natural_encode_kernel(bits, draws, exponents, signs, n, BLOCK: tl.constexpr):
    """natural's compress on fp32 bits: e = min((|bits| + u) >> 23, 254) for a finite x (0 stays
    0: u < 2^23), 255 for ±inf and NaN; the sign bits packed eight per byte."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, 8)
    index = rows[:, None] * 8 + lanes[None, :]
    inside = index < n
    raw = tl.load(bits + index, mask=inside, other=0)
    magnitude = raw & 0x7FFFFFFF
    rounded = (tl.minimum(magnitude, 0x7F800000) + tl.load(draws + index, mask=inside, other=0)) >> 23
    exponent = tl.where(magnitude < 0x7F800000, tl.minimum(rounded, 254), 255)
    tl.store(exponents + index, exponent.to(tl.uint8), mask=inside)
    byte = tl.sum((raw < 0).to(tl.int32) << lanes[None, :], axis=1)
    tl.store(signs + rows, byte.to(tl.uint8), mask=rows * 8 < n)


@triton.jit
def natural_decode_kernel(exponents, signs, out, n, BLOCK: tl.constexpr):
    """natural's decompress into fp32 bits: e << 23 | sign << 31 (e = 0: ±0)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, 8)
    index = rows[:, None] * 8 + lanes[None, :]
    inside = index < n
    byte = tl.load(signs + rows, mask=rows * 8 < n, other=0).to(tl.int32)
    sign = (byte[:, None] >> lanes[None, :]) & 1
    exponent = tl.load(exponents + index, mask=inside, other=0).to(tl.int32)
    tl.store(out + index, (exponent << 23) | (sign << 31), mask=inside)


@triton.jit
def rank_key(source, index, inside, ABS: tl.constexpr, INF: tl.constexpr):
    """|x|'s bits as an int32 key that orders like |x| with every NaN one key above ∞ (torch.topk
    ranks NaN above everything, and NaNs alike); outside ``inside``, −1 (below every key)."""
    magnitude = (tl.load(source + index, mask=inside, other=0) & ABS).to(tl.int32)
    return tl.where(inside, tl.minimum(magnitude, INF + 1), -1)


@triton.jit
def radix_histogram_kernel(
    source, state, hist, n, SHIFT: tl.constexpr, ABS: tl.constexpr, INF: tl.constexpr, BLOCK: tl.constexpr
):
    """One pass of the k-th largest key's radix select: among the keys whose bits above
    SHIFT + 8 are the prefix found so far (state[0]), how many have each 8-bit digit at SHIFT."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key = rank_key(source, index, index < n, ABS, INF)
    if SHIFT + 8 < 32:
        match = (key >= 0) & ((key >> (SHIFT + 8)) == (tl.load(state) >> (SHIFT + 8)))
    else:
        match = key >= 0
    counts = tl.histogram((key >> SHIFT) & 255, 256, mask=match)
    tl.atomic_add(hist + tl.arange(0, 256), counts, sem="relaxed")


@triton.jit
def radix_pick_kernel(hist, state, SHIFT: tl.constexpr):
    """The digit at SHIFT of the k-th largest key, in one program: the highest digit d whose
    count from the top reaches the rank r still sought (state[1]); r less the keys of the digits
    above d, and d, go into state."""
    digits = tl.arange(0, 256)
    counts = tl.load(hist + 255 - digits)  # from the highest digit down
    from_top = tl.cumsum(counts, axis=0)
    rank = tl.load(state + 1)
    above = from_top < rank
    digit = 255 - tl.sum(above.to(tl.int32), axis=0)
    tl.store(state + 1, rank - tl.sum(tl.where(above, counts, 0), axis=0))
    tl.store(state, tl.load(state) | (digit << SHIFT))


@triton.jit
def top_count_kernel(source, state, greater, tied, n, ABS: tl.constexpr, INF: tl.constexpr, BLOCK: tl.constexpr):
    """Per block: how many keys are above the k-th largest κ (state[0]) and how many equal it."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key = rank_key(source, index, index < n, ABS, INF)
    kth = tl.load(state)
    tl.store(greater + tl.program_id(0), tl.sum((key > kth).to(tl.int32), axis=0))
    tl.store(tied + tl.program_id(0), tl.sum((key == kth).to(tl.int32), axis=0))


@triton.jit
def top_compact_kernel(
    source, state, greater_before, tied_before, indices, n, ABS: tl.constexpr, INF: tl.constexpr, BLOCK: tl.constexpr
):
    """The top k's indices in ascending order: every key above κ, and the first r keys equal to
    it (r = state[1]); element i goes to slot (keys above κ before i) + min(ties before i, r)."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    key = rank_key(source, index, index < n, ABS, INF)
    kth, wanted = tl.load(state), tl.load(state + 1)
    above, tie = (key > kth).to(tl.int32), (key == kth).to(tl.int32)
    above_before = tl.load(greater_before + tl.program_id(0)) + tl.cumsum(above, axis=0) - above
    ties_before = tl.load(tied_before + tl.program_id(0)) + tl.cumsum(tie, axis=0) - tie
    chosen = (above == 1) | ((tie == 1) & (ties_before < wanted))
    slot = above_before.to(tl.int64) + tl.minimum(ties_before, wanted)
    tl.store(indices + slot, index, mask=chosen)


@triton.jit
def statq_encode_kernel(
    values,
    shift,
    scale,
    packed,
    sums,
    counts,
    n,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    LEVELS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """statq's compress: c = x − μ, q = clamp(round(c/s + L/2), 0, L − 1) (round half to even,
    from the floor and the exact fraction; NaN: 0, as torch's cast on a CPU), the codes packed
    PER to a byte, and this program's per-bin sums of c (fp64) and counts in its own row."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = tl.arange(0, PER)
    index = rows[:, None] * PER + lanes[None, :]
    inside = index < n
    centered = tl.load(values + index, mask=inside, other=0.0) - tl.load(shift)
    grid = tl.div_rn(centered, tl.load(scale)) + (LEVELS // 2)
    grid = tl.where(grid > LEVELS, LEVELS, tl.where(grid < -1.0, -1.0, grid))  # rounds and clamps alike
    floor = tl.floor(grid)
    fraction = grid - floor  # exact: floor ≤ grid < floor + 1, both ≥ −1
    odd = (floor.to(tl.int32) & 1) == 1
    code = floor.to(tl.int32) + ((fraction > 0.5) | ((fraction == 0.5) & odd)).to(tl.int32)
    code = tl.where((grid != grid) | ~inside, 0, tl.minimum(tl.maximum(code, 0), LEVELS - 1))
    byte = tl.sum(code << (lanes[None, :] * BITS), axis=1)  # disjoint bits: the sum is an OR
    tl.store(packed + rows, byte.to(tl.uint8), mask=rows * PER < n)
    row = tl.program_id(0).to(tl.int64) * LEVELS
    every, counted = tl.reshape(code, [BLOCK * PER]), tl.reshape(inside, [BLOCK * PER])  # a histogram is 1-D
    tl.store(counts + row + tl.arange(0, LEVELS), tl.histogram(every, LEVELS, mask=counted))
    wide = centered.to(tl.float64)
    if LEVELS <= 16:  # a masked sum per bin
        for level in tl.static_range(LEVELS):
            tl.store(sums + row + level, tl.sum(tl.sum(tl.where(inside & (code == level), wide, 0.0), axis=1), axis=0))
    else:  # 256 bins: each element adds into its bin of this program's row
        tl.atomic_add(sums + row + code, wide, mask=inside, sem="relaxed")


@triton.jit
def chunk_top_k_kernel(
    source,
    values,
    offsets,
    C,
    K,
    ABS: tl.constexpr,
    INF: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """chunk_topk's selection, one chunk of C elements per program, in registers: the K-th largest
    key κ of the chunk by a radix select (8 bits a pass, each digit from the pass's histogram), then
    the keys above κ and the first keys equal to it, written in ascending order (offset and value)."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < C
    raw = tl.load(source + row * C + columns, mask=inside, other=0)
    key = tl.where(inside, tl.minimum((raw & ABS).to(tl.int32), INF + 1), -1)
    prefix = 0
    rank = K
    for step in tl.static_range(WIDTH // 8):
        shift = WIDTH - 8 - 8 * step
        if step == 0:
            match = key >= 0
        else:
            match = (key >= 0) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
        counts = tl.histogram((key >> shift) & 255, 256, mask=match)
        from_top = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # keys of this digit or above
        above = from_top < rank
        prefix = prefix | ((255 - tl.sum(above.to(tl.int32), axis=0)) << shift)
        rank = rank - tl.sum(tl.where(above, counts, 0), axis=0)
    tie = (key == prefix).to(tl.int32)
    chosen = (key > prefix) | ((tie == 1) & (tl.cumsum(tie, axis=0) - tie < rank))
    slot = row * K + tl.cumsum(chosen.to(tl.int32), axis=0) - chosen.to(tl.int32)
    tl.store(offsets + slot, columns.to(tl.int64), mask=chosen)
    tl.store(values + slot, raw, mask=chosen)
