"""Fused GPU kernels (Triton) for the bit packing, the sign and 2-bit codecs and the
threshold selection of the compressors (the kernels themselves: :mod:`grace_dgc.kernels.triton`).

Why: on a GPU every torch op is a kernel launch and a full pass over memory. Packing 1-, 2- or
4-bit codes by the SWAR stages of :mod:`grace_dgc.wire` takes about ten such passes over the
codes, a method's encoder a few more over the gradient, and a selection |x| ≥ τ four (abs,
compare, nonzero's scan, a gather). Each kernel here reads its input once and writes its output
once (the selection: two reads):

    pack(codes, bits)          byte b = Σ_j codes[p·b + j] << (j·bits),  p = 8 / bits
    unpack(packed, bits, n)    codes[p·b + j] = (packed[b] >> (j·bits)) & (2^bits − 1)
    pack_signs(x)              pack(x ≥ 0, 1) without the bool tensor in between (the sign methods)
    pack_ternary(x, τ)         pack(3 if x ≥ τ, 2 if x ≤ −τ, else 0; 2) (twobit's encoder)
    sign_split(x, picked)      pack(x ≥ 0, 1), picked = bits(x) where x ≥ 0 else 0, and the count
                               (1-bit SGD's encoder; its sums stay torch's)
    unpack_lookup(p, bits, out, table)
                               out_i = table[code_i] as fp32 (the sign methods' and twobit's decoder)
    at_least(x, τ)             ascending indices and |x| of the elements with |x| ≥ τ: a count per
                               block, a running sum, then each block writes its hits in order
                               (DGC's, top-k's and threshold's selection)
    rotate(x, D)               thc's H·D·x/√d (x zero-padded to d = 2^m): the m butterfly stages
                               on tiles held in registers, 12 in a first pass, up to 7 in each later
                               one (3 passes at d = 2^25, where the torch ops make 25 passes)
    unrotate(codes, f, D, out) thc's decoder: out = the first n of D·H·(codes·f)/√d, likewise
    stochastic_codes(x, r, f, K, dtype)
                               thc's rounding: ⌊u⌋ + (r < u − ⌊u⌋), u = x·f clamped to [−K, K]
    qsgd_codes(x, r, f, s, size, out)
                               qsgd's levels: s + sgn(x)·(⌊u⌋ + (r < u − ⌊u⌋)), u = min(|x|·f_b, s),
                               f_b = s/‖v‖ of x's bucket b (the norms stay torch's)
    qsgd_values(codes, g, s, size, out)
                               qsgd's decoder: out = (code − s)·g_b, g_b = ‖v‖/s of the bucket
    fp8_encode(x, block, format)   fp8's codes and block scales: s_b = max|x|/F, fp8(x/s_b) rounded to
                               nearest even from the bits (integer ops), in one read of x
    fp8_decode(codes, s, block, format, out)
                               out = s_b · fp32(code), the value from a 256-entry table
    fp4_encode(x, s)           fp4's E3M0 codes under its power-of-two scale s (read on the device),
                               two per byte, from y = |x|/s's bits, in one read of x
    fp4_decode(packed, s, out) out = ±s·2^(e−7) (e = 0: ±0), the power of two built from the code
    terngrad_encode(x, r, b, s) terngrad's 2-bit codes: 1 + sgn bit of ĝ = clamp(x, ±b) where
                               r < |ĝ|/s, else 0 (b, s read on the device)
    natural_encode(x, u, e)    natural's exponents min((|bits(x)| + u) >> 23, 254) (255: ±inf, NaN)
                               and its sign bits, in one read of x
    natural_decode(e, signs, out)
                               out = bits e << 23 | sign << 31
    chunk_top_k(x, C, k, o, v) chunk_topk's offsets of the k largest |x| of each chunk of C (ascending; ties:
                               the lowest) and the values there: a radix select per chunk in registers, one
                               program a chunk
    statq_encode(x, μ, s, b)   statq's codes clamp(round((x − μ)/s + L/2), 0, L − 1) packed, and each bin's
                               sum (fp64) and count, per program then summed, in one read of x
    top_k_indices(x, k)        top-k's ascending indices of the k largest |x| (ties: the lowest indices): the
                               k-th largest |x|'s bits by a radix select (a histogram of 8 bits a pass,
                               the digit picked on the device), then a count and an ordered write
    random_indices(n, k, bits, keys)
                               random-k's S_t: π(i) for i < k, a keyed Feistel permutation walked
                               into range(n) (integer arithmetic only, so bit for bit the torch ops)

Each writes the same bytes as the torch path it replaces (the packed stream of
:func:`grace_dgc.wire.pack_bits`, element i at bits [i·bits, (i+1)·bits); τ rounded to the
input's dtype before comparing, as torch rounds a Python scalar), tested bit for bit. So the
choice of path is rank-local and the handshake does not compare it: ranks that run different
paths still exchange the same bytes.

Which path runs (``GRACE_DGC_KERNELS``, read once when first needed; :func:`set_mode` or
``with use(...)`` at run time):

- ``auto`` (default): these kernels for CUDA tensors when Triton imports (it ships with the
  CUDA builds of torch), the torch/numpy paths otherwise: the CPU path is unchanged;
- ``torch``: never these kernels (to compare, or to rule them out);
- ``triton``: always, CPU tensors too — which runs only under Triton's interpreter
  (``TRITON_INTERPRET=1``): how the tests prove the kernels on a machine without a GPU.

A kernel that fails to build or launch in ``auto`` mode (no C compiler for Triton's launcher,
an unsupported GPU) is warned about once, and the torch path runs from then on. The kernels
are imported on first use, so importing grace_dgc never imports Triton.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..errors import GraceConfigError

MODES = ("auto", "torch", "triton")
AUTO_DEVICES = ("cuda",)  # where ``auto`` uses the kernels
CODES, SIGNS, TERNARY = 0, 1, 2  # what pack_kernel reads: codes, signs of x, twobit's codes of x
BLOCK = 1024  # packed bytes per program: 8192 one-bit codes
T = TypeVar("T")

failure: str | None = None  # why the kernels failed in this process (auto mode then stops using them)


class Unavailable(RuntimeError):
    """A kernel could not be built or launched here (no C compiler for Triton's launcher, an
    unsupported GPU, a Triton incompatible with this torch...): in ``auto`` mode the caller
    runs the torch path instead, and so does every later call in this process."""


_mode: str | None = None  # the mode in force; None: read GRACE_DGC_KERNELS when next asked


def mode() -> str:
    """The mode in force: :func:`set_mode`'s, else ``GRACE_DGC_KERNELS`` read once and checked
    (one of :data:`MODES`; see grace_dgc.environment). Read once because it is asked on every
    pack and selection, where an environment lookup would cost more than the answer."""
    global _mode
    if _mode is None:
        text = os.environ.get("GRACE_DGC_KERNELS", "auto")
        value = text.strip().lower() or "auto"
        if value not in MODES:
            raise GraceConfigError(f"GRACE_DGC_KERNELS={text!r} in the environment; accepted: {', '.join(MODES)}")
        _mode = value
    return _mode


def set_mode(value: str | None) -> None:
    """Choose the path at run time (``auto``, ``torch`` or ``triton``); None: the environment's
    again, read when next asked."""
    global _mode
    if value is not None and value not in MODES:
        raise GraceConfigError(f"kernel mode {value!r}; accepted: {', '.join(MODES)}")
    _mode = value


@contextlib.contextmanager
def use(value: str) -> Iterator[None]:
    """``with use("torch"):`` — :func:`set_mode` for a block, the previous mode after it."""
    previous = _mode
    set_mode(value)
    try:
        yield
    finally:
        set_mode(previous)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels read as floats (fp64: torch's path)


# Kernels proven bit for bit under Triton's interpreter but not yet on a GPU: ``auto`` leaves
# them off (``triton`` runs them). A new kernel enters here until a GPU run of its CUDA cases
# passes. fp8's and random-k's left on the H100 of 2026-12-05 (their CUDA cases passed compiled;
# fp8's torch path now divides by a device tensor, as the kernel does: CUDA divides by a Python
# scalar as a multiply by its reciprocal, 1 ulp off). fp4's and lookup_table's (2026-12-05, proven
# on the CPU's interpreter) wait for a GPU: meanwhile onebit decodes its on-device means with the
# torch ops there (no host read either way). terngrad's, natural's, top_k's, statq's and chunk_top_k's
# (2026-12-06) likewise.
UNPROVEN: frozenset[str] = frozenset({"fp4", "lookup_table", "terngrad", "natural", "top_k", "statq", "chunk_top_k"})


def enabled(device: torch.device | str, dtype: torch.dtype | None = None, kernel: str | None = None) -> bool:
    """Do the fused kernels run on tensors on ``device`` (of float ``dtype``, when given: the
    kernels compare in fp32, exact for these three, not for fp64)? ``kernel`` names one of
    :data:`UNPROVEN`, which ``auto`` leaves off. (See the module's doc.) Asked on every pack
    and selection, CPU ones too."""
    chosen = _mode or mode()
    if chosen == "torch" or (dtype is not None and dtype not in FLOATS):
        return False
    device = device if isinstance(device, torch.device) else torch.device(device)
    if chosen == "auto":
        if kernel in UNPROVEN:
            return False
        return device.type in AUTO_DEVICES and failure is None and _triton_importable()
    if not _triton_importable():
        raise RuntimeError("GRACE_DGC_KERNELS=triton, but Triton does not import: install triton, or use auto/torch")
    if device.type != "cuda" and not _interpreted():
        raise RuntimeError(
            f"GRACE_DGC_KERNELS=triton on a {device.type} tensor needs Triton's interpreter (TRITON_INTERPRET=1); "
            "on a GPU it needs a CUDA tensor"
        )
    return True


def attempt(
    launch: Callable[[], T], device: torch.device | str, dtype: torch.dtype | None = None, kernel: str | None = None
) -> T | None:
    """``launch()`` (a fused kernel) where the kernels run (:func:`enabled`), else None; a
    kernel that fails (:class:`Unavailable`, warned once) is None too. The one fallback rule of
    every caller: on None, its torch ops follow, and give the same result bit for bit::

        fused = kernels.attempt(lambda: kernels.pack_ternary(flat, tau), flat.device, flat.dtype)
        if fused is not None:
            return fused
        ...  # the torch ops
    """
    if not enabled(device, dtype, kernel):
        return None
    try:
        return launch()
    except Unavailable:  # warned by the kernel's launch
        return None


@functools.cache
def _kernels() -> Any:
    """The module of jitted kernels, imported once (Triton reads TRITON_INTERPRET then)."""
    from . import triton as triton_kernels

    return triton_kernels


def _launch(name: str, grid: tuple[int], first: Tensor, *args: object, **meta: object) -> None:
    """Kernel ``name`` on ``grid`` over ``first`` and ``args``, on ``first``'s GPU (Triton
    launches on the current device's current stream: a rank's communication thread starts on
    GPU 0 whatever the rank's device); in ``auto`` mode a failure is warned about once and
    raised as :class:`Unavailable` (the caller's cue to run the torch path), else raised."""
    global failure
    try:
        kernel = getattr(_kernels(), f"{name}_kernel")[grid]
        if first.is_cuda:
            with torch.cuda.device(first.device):
                kernel(first, *args, **meta)
        else:
            kernel(first, *args, **meta)
    except Exception as error:
        if mode() != "auto":
            raise
        failure = f"{type(error).__name__}: {error}".strip()
        warnings.warn(
            f"grace_dgc's fused Triton kernels failed here ({failure.splitlines()[0]}); the torch ops take over "
            "for the rest of this process (GRACE_DGC_KERNELS=torch turns the kernels off)",
            RuntimeWarning,
            stacklevel=3,
        )
        raise Unavailable(failure) from error


def _blocks(size: int) -> tuple[int]:
    return (-(-size // BLOCK),)


def _flat(tensor: Tensor) -> Tensor:
    """``tensor`` as a contiguous 1-D tensor (a view when it already is one)."""
    return tensor.reshape(-1).contiguous()


def _check_out(out: Tensor, size: int, dtype: torch.dtype, device: torch.device) -> None:
    if out.numel() < size or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of at least {size} elements on {device}; "
            f"got {out.dtype}, {out.numel()} elements on {out.device}"
        )


def _check_float(values: Tensor) -> None:
    if values.dtype not in FLOATS:
        raise ValueError(f"values must be float32, float16 or bfloat16 (compared in fp32, exactly); got {values.dtype}")


def _bits_ok(bits: int) -> None:
    if bits not in (1, 2, 4):
        raise ValueError(f"bits={bits!r}; the fused kernels pack 1, 2 or 4 bits")


def pack(codes: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """``codes`` (uint8 or bool, each < 2**bits) packed to ⌈n·bits/8⌉ bytes (into ``out``)."""
    _bits_ok(bits)
    codes = _flat(codes.view(torch.uint8) if codes.dtype == torch.bool else codes)
    n = codes.numel()
    size = (n * bits + 7) // 8
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=codes.device)
    _check_out(out, size, torch.uint8, codes.device)
    if size:
        meta = {"BITS": bits, "PER": 8 // bits, "MODE": CODES, "ABS": 0, "INF": 0, "BLOCK": BLOCK}
        _launch("pack", _blocks(size), codes, out, n, 0, **meta)
    return out


def pack_signs(values: Tensor, out: Tensor | None = None) -> Tensor:
    """Bit i = 1 where ``values_i ≥ 0``, packed 8 per byte: ``pack(values >= 0, 1)`` in one pass."""
    values = _flat(values)
    _check_float(values)
    n = values.numel()
    size = (n + 7) // 8
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=values.device)
    _check_out(out, size, torch.uint8, values.device)
    if n:
        bits, limits = _layout(values)
        _launch("pack", _blocks(size), bits, out, n, 0, BITS=1, PER=8, MODE=SIGNS, **limits, BLOCK=BLOCK)
    return out


def sign_split(values: Tensor, picked: Tensor) -> tuple[Tensor, Tensor]:
    """1-bit SGD's encoder in one pass over fp32 ``values``: the sign bits (``x ≥ 0``, packed
    8 per byte), ``picked`` (int32, the values' bits where x ≥ 0, else 0: the positive group for
    a sum) written in place, and how many are ≥ 0 (a 0-d int64 tensor)."""
    values = _flat(values)
    if values.dtype != torch.float32:
        raise ValueError(f"sign_split takes float32 values; got {values.dtype}")
    n = values.numel()
    _check_out(picked, n, torch.int32, values.device)
    size = (n + 7) // 8
    packed = torch.empty(size, dtype=torch.uint8, device=values.device)
    grid = _blocks(size)
    counts = torch.zeros(grid[0], dtype=torch.int32, device=values.device)
    if n:
        _launch("sign_split", grid, values.view(torch.int32), packed, picked, counts, n, BLOCK=BLOCK)
    return packed, counts.sum()


def unpack(packed: Tensor, bits: int, n: int, out: Tensor | None = None) -> Tensor:
    """The first ``n`` codes of a :func:`pack` stream as uint8 (into ``out``)."""
    _bits_ok(bits)
    packed = _flat(packed)
    size = (n * bits + 7) // 8
    if packed.numel() < size:
        raise ValueError(f"{n} codes of {bits} bits need {size} bytes; the packed stream has {packed.numel()}")
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    _check_out(out, n, torch.uint8, packed.device)
    if n:
        _launch("unpack", _blocks(size), packed, out, n, BITS=bits, PER=8 // bits, BLOCK=BLOCK)
    return out


def pack_ternary(values: Tensor, threshold: float, out: Tensor | None = None) -> Tensor:
    """2-bit codes 3 where ``values_i ≥ τ``, 2 where ``values_i ≤ −τ``, else 0 (τ > 0),
    packed 4 per byte in one pass: twobit's encoder. τ is compared in the values' dtype (rounded
    to it first), as ``torch.ge(values, τ)`` compares."""
    values = _flat(values)
    _check_float(values)
    n = values.numel()
    size = (n * 2 + 7) // 8
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=values.device)
    _check_out(out, size, torch.uint8, values.device)
    if not float(threshold) > 0:
        raise ValueError(f"threshold={threshold!r}; pack_ternary takes a threshold > 0")
    if n:
        bits, limits = _layout(values)
        tau = _threshold_bits(threshold, values.dtype, keep_nan=False)
        meta = {"BITS": 2, "PER": 4, "MODE": TERNARY, **limits, "BLOCK": BLOCK}
        _launch("pack", _blocks(size), bits, out, n, tau, **meta)
    return out


# per float dtype: the integer of its width, |x|'s mask (all but the sign bit), +infinity's bits
_LAYOUT = {
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
}


def _layout(values: Tensor) -> tuple[Tensor, dict[str, int]]:
    """``values`` as the integers of their bit patterns, and the kernels' ABS and INF."""
    integer, magnitude_mask, infinity = _LAYOUT[values.dtype]
    return values.view(integer), {"ABS": magnitude_mask, "INF": infinity}


def _threshold_bits(threshold: float, dtype: torch.dtype, keep_nan: bool) -> int:
    """The bits of τ ≥ 0 rounded to ``dtype`` (as torch rounds a Python scalar it compares a
    tensor with), for the kernels' integer tests of |x| ≥ τ; a NaN τ (no |x| ≥ NaN, every
    ~(|x| < NaN)) as the bits that select nothing, or everything with ``keep_nan``."""
    integer, _, infinity = _LAYOUT[dtype]
    value = float(threshold)
    if value != value:
        return 0 if keep_nan else infinity + 1
    if value <= 0:
        return 0  # |x| ≥ 0 (or a negative τ): every number
    return int(torch.tensor(value, dtype=dtype).view(integer).item())


def _fp32_bits(values: list[float]) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def unpack_lookup(packed: Tensor, bits: int, out: Tensor, table: Sequence[float | Tensor]) -> Tensor:
    """``out_i = table[code_i]`` for the 1- or 2-bit codes of a packed stream, into ``out`` (a
    contiguous fp32 tensor, returned); each table value rounded to fp32 once, as torch rounds a
    scalar it writes into an fp32 tensor. Values given as (one-element) tensors are read on the
    device, never on the host."""
    if bits not in (1, 2) or len(table) != 1 << bits:
        raise ValueError(f"a lookup takes 1 or 2 bits and 2**bits table values; got bits={bits}, {len(table)} values")
    packed = _flat(packed)
    n = out.numel()
    size = (n * bits + 7) // 8
    if packed.numel() < size:
        raise ValueError(f"{n} codes of {bits} bits need {size} bytes; the packed stream has {packed.numel()}")
    _check_out(out, n, torch.float32, packed.device)
    if n and any(isinstance(v, Tensor) for v in table):
        values = torch.stack([torch.as_tensor(v).reshape(()).to(out.device, torch.float32) for v in table])
        _launch(
            "lookup_table", _blocks(size), packed, out.view(torch.int32), n, values.view(torch.int32),
            BITS=bits, PER=8 // bits, BLOCK=BLOCK,
        )  # fmt: skip
    elif n:
        words = _fp32_bits([float(v) for v in table] * (4 // len(table)))
        _launch(
            "lookup", _blocks(size), packed, out.view(torch.int32), n, *words, BITS=bits, PER=8 // bits, BLOCK=BLOCK
        )
    return out


def unpack_select(packed: Tensor, out: Tensor, if_set: float | Tensor, if_clear: float | Tensor) -> Tensor:
    """``out_i = if_set`` where bit i of a 1-bit stream is 1, else ``if_clear`` (see :func:`unpack_lookup`)."""
    return unpack_lookup(packed, 1, out, [if_clear, if_set])


SELECT_BLOCK = 4096  # elements per program of at_least


def at_least(values: Tensor, threshold: float, keep_nan: bool = True) -> tuple[Tensor, Tensor]:
    """``(indices, magnitudes)`` of the elements with ``|x| ≥ τ``, ascending, a NaN counting as
    large with ``keep_nan`` (as ``~(|x| < τ)``), as small without: the sparsifiers' selection
    (:func:`grace_dgc.compressors.sparse.at_least`) in two reads of ``values`` and no
    full-size temporary — a count per block, their running sum, then each block writes its
    hits at its offset in order. τ is compared in the values' dtype, rounded to it first."""
    values = _flat(values)
    _check_float(values)
    n = values.numel()
    if n == 0:
        return values.new_empty(0, dtype=torch.int64), values.new_empty(0)
    tau = _threshold_bits(threshold, values.dtype, keep_nan)
    bits, limits = _layout(values)
    meta = {"KEEP_NAN": keep_nan, **limits, "BLOCK": SELECT_BLOCK}
    grid = (-(-n // SELECT_BLOCK),)
    counts = torch.empty(grid[0], dtype=torch.int32, device=values.device)
    _launch("count", grid, bits, counts, n, tau, **meta)
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1])  # the output's size: one host sync, as torch.nonzero's
    indices = torch.empty(total, dtype=torch.int64, device=values.device)
    magnitudes = torch.empty(total, dtype=values.dtype, device=values.device)
    if total:
        starts = ends - counts
        _launch("compact", grid, bits, starts, indices, magnitudes.view(bits.dtype), n, tau, **meta)
    return indices, magnitudes


# -- statq ---------------------------------------------------------------------------------------

STATQ_ELEMENTS = 4096  # elements per program of statq_encode (a row of partial sums each)


def statq_encode(values: Tensor, shift: Tensor, scale: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """statq's compress (:class:`grace_dgc.compressors.statq.StatisticalQuantizer`) of fp32
    ``values`` under its mean μ and grid step s (one fp32 element each, read on the device) in one
    read: the b-bit codes packed (the bytes of its torch ops), and each bin's sum of x − μ (fp64)
    and count (int64), summed over per-program rows (no host sync, no contended atomics but
    256 bins' own)."""
    if values.dtype != torch.float32:
        raise ValueError(f"statq_encode takes fp32 values; got {values.dtype}")
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits={bits!r}; statq packs 1, 2, 4 or 8 bits")
    values = _flat(values)
    _check_scale(shift, values.device)
    _check_scale(scale, values.device)
    n, levels, per = values.numel(), 1 << bits, 8 // bits
    programs = max(1, -(-n // STATQ_ELEMENTS))
    packed = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=values.device)
    sums = torch.zeros(programs, levels, dtype=torch.float64, device=values.device)
    counts = torch.zeros(programs, levels, dtype=torch.int32, device=values.device)
    if n:
        meta = {"BITS": bits, "PER": per, "LEVELS": levels, "BLOCK": STATQ_ELEMENTS // per}
        _launch("statq_encode", (programs,), values, shift, scale, packed, sums, counts, n, **meta)
    return packed, sums.sum(0), counts.sum(0)


# -- top-k's selection -----------------------------------------------------------------------------

TOP_BLOCK = 4096  # elements per program of top_k_indices' passes


def top_k_indices(values: Tensor, k: int) -> Tensor:
    """Ascending indices of the ``k`` largest ``|x|`` (NaN above everything, ties at the k-th
    going to the lowest indices): top-k's selection (:func:`grace_dgc.compressors.topk.exact_top_k`)
    with no host sync. The k-th largest key κ (|x|'s bits) by a radix select, 8 bits a pass (4
    passes for fp32, 2 for fp16/bf16), the digit picked on the device; then a count per block of
    the keys above and at κ, their running sums, and each block writes its chosen indices in order."""
    values = _flat(values)
    _check_float(values)
    n = values.numel()
    if not 0 < k <= n:
        raise ValueError(f"top_k_indices: k={k!r}; accepted: 1 … {n} (the values' count)")
    bits, limits = _layout(values)
    device, grid = values.device, (-(-n // TOP_BLOCK),)
    state = torch.zeros(2, dtype=torch.int32, device=device)  # κ's bits found so far, the rank r still sought
    state[1:].fill_(k)  # a fill on the device: no copy from the host
    shifts = range(8 * bits.element_size() - 8, -1, -8)
    hist = torch.zeros(len(shifts), 256, dtype=torch.int32, device=device)
    for row, shift in enumerate(shifts):
        _launch("radix_histogram", grid, bits, state, hist[row], n, SHIFT=shift, **limits, BLOCK=TOP_BLOCK)
        _launch("radix_pick", (1,), hist[row], state, SHIFT=shift)
    greater, tied = torch.empty(2, grid[0], dtype=torch.int32, device=device)
    _launch("top_count", grid, bits, state, greater, tied, n, **limits, BLOCK=TOP_BLOCK)
    greater_before, tied_before = torch.cumsum(greater, 0) - greater, torch.cumsum(tied, 0) - tied  # int64
    indices = torch.empty(k, dtype=torch.int64, device=device)
    _launch("top_compact", grid, bits, state, greater_before, tied_before, indices, n, **limits, BLOCK=TOP_BLOCK)
    return indices


CHUNK_TOP_LARGEST = 8192  # chunk_topk's chunks a program holds in registers; longer ones: torch's ops


def chunk_top_k(values: Tensor, chunk: int, k: int, offsets: Tensor, picked: Tensor) -> Tensor:
    """chunk_topk's selection (:class:`grace_dgc.compressors.chunk_topk.ChunkTopKCompressor`) of
    the whole chunks of ``values`` (n a multiple of ``chunk``): into ``offsets`` (int64) and
    ``picked`` (the values' dtype), k per chunk, the offsets of its k largest |x| ascending (NaN
    above everything, ties at the k-th to the lowest offsets) and the values there (returns
    ``offsets``). One launch, one program per chunk, no host sync."""
    values = _flat(values)
    _check_float(values)
    n = values.numel()
    if not 0 < chunk <= CHUNK_TOP_LARGEST or n % chunk or not 0 < k <= chunk:
        raise ValueError(
            f"chunk_top_k: chunk={chunk}, k={k} over {n} values; accepted: 1 ≤ k ≤ chunk ≤ {CHUNK_TOP_LARGEST}, "
            "n a multiple of chunk"
        )
    _check_out(offsets, n // chunk * k, torch.int64, values.device)
    _check_out(picked, n // chunk * k, values.dtype, values.device)
    if n:
        bits, limits = _layout(values)
        meta = {**limits, "WIDTH": 8 * bits.element_size(), "BLOCK": 1 << max(0, chunk - 1).bit_length()}
        _launch("chunk_top_k", (n // chunk,), bits, picked.view(bits.dtype), offsets, chunk, k, **meta)
    return offsets


# -- random-k's indices -------------------------------------------------------------------------

RANDOM_BLOCK = 1024


def random_indices(n: int, k: int, bits: int, keys: list[int], device: torch.device) -> Tensor:
    """random-k's S_t (:func:`grace_dgc.compressors.randomk.keyed_indices`) in one launch: π(i)
    for i < k, each walked into range(n) in registers; the same bits as the torch ops."""
    a, b = bits // 2, bits - bits // 2
    out = torch.empty(k, dtype=torch.int64, device=device)
    grid = (-(-k // RANDOM_BLOCK),)
    _launch("random_indices", grid, out, k, n, a, b, (1 << a) - 1, (1 << b) - 1, *keys, 0xFFFFFFFF,
            BLOCK=RANDOM_BLOCK)  # fmt: skip
    return out


# -- fp8 ----------------------------------------------------------------------------------------

FP8_FORMATS = {"e4m3": (3, 7, True, torch.float8_e4m3fn), "e5m2": (2, 15, False, torch.float8_e5m2)}
FP8_TILE = 2048  # elements per program: ROWS blocks of the next power of two ≥ the block
FP8_LARGEST_BLOCK = 8192  # larger blocks: torch's ops


def _fp8_tile(block: int) -> dict[str, int]:
    columns = 1 << max(0, block - 1).bit_length()
    return {"ROWS": max(1, FP8_TILE // columns), "COLS": columns}


def fp8_encode(values: Tensor, block: int, format: str) -> tuple[Tensor, Tensor]:
    """fp8's compress (:class:`grace_dgc.compressors.fp8.FP8Compressor`) in one pass over fp32
    ``values``: (the codes as uint8, one fp32 scale per block), the bytes of torch's ops."""
    mantissa, bias, saturate, dtype = FP8_FORMATS[format]
    if values.dtype != torch.float32 or block > FP8_LARGEST_BLOCK:
        raise ValueError(f"fp8_encode takes fp32 values and blocks up to {FP8_LARGEST_BLOCK}")
    values = _flat(values)
    n = values.numel()
    blocks = -(-n // block)
    codes = torch.empty(n, dtype=torch.uint8, device=values.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=values.device)
    tile = _fp8_tile(block)
    grid = (-(-blocks // tile["ROWS"]),)
    largest = float(torch.finfo(dtype).max)
    _launch("fp8_encode", grid, values, codes, scales, n, blocks, block, largest,
            MANT=mantissa, BIAS=bias, SATURATE=saturate, **tile)  # fmt: skip
    return codes, scales


@functools.cache
def _fp8_table(format: str, device: torch.device) -> Tensor:
    """The fp32 value of each of the 256 codes."""
    return torch.arange(256, dtype=torch.uint8).view(FP8_FORMATS[format][3]).float().to(device)


def fp8_decode(codes: Tensor, scales: Tensor, block: int, format: str, out: Tensor) -> Tensor:
    """fp8's decompress into the contiguous fp32 ``out``: s_b · fp32(code), as torch's ops."""
    n = codes.numel()
    _check_out(out, n, torch.float32, codes.device)
    if block > FP8_LARGEST_BLOCK:
        raise ValueError(f"fp8_decode takes blocks up to {FP8_LARGEST_BLOCK}")
    blocks = -(-n // block)
    tile = _fp8_tile(block)
    grid = (-(-blocks // tile["ROWS"]),)
    _launch("fp8_decode", grid, codes, scales, _fp8_table(format, codes.device), out, n, blocks, block, **tile)
    return out


FP4_BLOCK = 1024  # packed bytes per program of fp4_encode and fp4_decode: 2048 codes


def _check_scale(scale: Tensor, device: torch.device) -> None:
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(
            f"scale must be one fp32 element on {device}; got {scale.dtype}, {scale.numel()} on {scale.device}"
        )


def fp4_encode(values: Tensor, scale: Tensor) -> Tensor:
    """fp4's compress (:class:`grace_dgc.compressors.fp4.FP4Compressor`) of fp32 ``values`` under
    its scale s (one fp32 element on their device, read there): the 4-bit codes packed two per
    byte, the bytes of its torch ops."""
    if values.dtype != torch.float32:
        raise ValueError(f"fp4_encode takes fp32 values; got {values.dtype}")
    values = _flat(values)
    _check_scale(scale, values.device)
    n = values.numel()
    packed = torch.empty(-(-n // 2), dtype=torch.uint8, device=values.device)
    if n:
        _launch("fp4_encode", _fp4_grid(n), values, scale, packed, n, BLOCK=FP4_BLOCK)
    return packed


def fp4_decode(packed: Tensor, scale: Tensor, out: Tensor) -> Tensor:
    """fp4's decompress into the contiguous fp32 ``out`` (its n codes): ±s·2^(e−7), e = 0 is ±0."""
    n = out.numel()
    _check_out(out, n, torch.float32, packed.device)
    _check_scale(scale, packed.device)
    if packed.numel() < -(-n // 2):
        raise ValueError(f"fp4_decode: {packed.numel()} bytes hold fewer than out's {n} codes")
    if n:
        _launch("fp4_decode", _fp4_grid(n), packed, scale, out, n, BLOCK=FP4_BLOCK)
    return out


def _fp4_grid(n: int) -> tuple[int]:
    packed_bytes = -(-n // 2)
    return (-(-packed_bytes // FP4_BLOCK),)


# -- terngrad and natural ------------------------------------------------------------------------


def _check_draws(draws: Tensor, n: int, dtype: torch.dtype, device: torch.device) -> None:
    if draws.numel() < n or draws.dtype != dtype or draws.device != device or not draws.is_contiguous():
        raise ValueError(
            f"the draws must be a contiguous {dtype} tensor of at least {n} elements on {device}; "
            f"got {draws.dtype}, {draws.numel()} elements on {draws.device}"
        )


def terngrad_encode(values: Tensor, uniform: Tensor, bound: Tensor, divisor: Tensor) -> Tensor:
    """terngrad's compress (:class:`grace_dgc.compressors.terngrad.TernGradCompressor`) of fp32
    ``values`` with its draws ``uniform`` and its clip bound b and scale s (one fp32 element each
    on their device, read there): the 2-bit codes packed four per byte, the bytes of its torch ops."""
    if values.dtype != torch.float32:
        raise ValueError(f"terngrad_encode takes fp32 values; got {values.dtype}")
    values = _flat(values)
    n = values.numel()
    _check_draws(uniform, n, torch.float32, values.device)
    _check_scale(bound, values.device)
    _check_scale(divisor, values.device)
    size = (n * 2 + 7) // 8
    packed = torch.empty(size, dtype=torch.uint8, device=values.device)
    if n:
        _launch("terngrad_encode", _blocks(size), values, uniform, bound, divisor, packed, n, BLOCK=BLOCK)
    return packed


def natural_encode(values: Tensor, draws: Tensor, exponents: Tensor) -> Tensor:
    """natural's compress (:class:`grace_dgc.compressors.natural.NaturalCompressor`) of fp32
    ``values`` with its int32 draws u < 2^23: the 8-bit exponents into ``exponents`` and the sign
    bits packed eight per byte (returned), the bytes of its torch ops."""
    if values.dtype != torch.float32:
        raise ValueError(f"natural_encode takes fp32 values; got {values.dtype}")
    values = _flat(values)
    n = values.numel()
    _check_draws(draws, n, torch.int32, values.device)
    _check_out(exponents, n, torch.uint8, values.device)
    signs = torch.empty((n + 7) // 8, dtype=torch.uint8, device=values.device)
    if n:
        _launch("natural_encode", _blocks(signs.numel()), values.view(torch.int32), draws, exponents, signs, n,
                BLOCK=BLOCK)  # fmt: skip
    return signs


def natural_decode(exponents: Tensor, signs: Tensor, out: Tensor) -> Tensor:
    """natural's decompress into the contiguous fp32 ``out`` (its n values): ±2^(e−127), e = 0 ±0."""
    n = out.numel()
    _check_out(out, n, torch.float32, exponents.device)
    if exponents.numel() < n or signs.numel() < (n + 7) // 8:
        raise ValueError(
            f"natural_decode: {exponents.numel()} exponents and {signs.numel()} sign bytes hold fewer than "
            f"out's {n} values"
        )
    if n:
        _launch("natural_decode", _blocks((n + 7) // 8), _flat(exponents), _flat(signs), out.view(torch.int32), n,
                BLOCK=BLOCK)  # fmt: skip
    return out


# -- THC's rotation ------------------------------------------------------------------------------

HADAMARD_LOG = 12  # the first pass: butterfly stages 0 … 11 within blocks of 4096 elements
COLUMN_LOG = 7  # each later pass: up to 7 stages, on tiles of 2^t rows × 4096 / 2^t columns
COLUMN_TILE = 1 << HADAMARD_LOG
HADAMARD_META = {"enable_fp_fusion": False}  # a product rounded on its own, as torch rounds it
ENCODE, DECODE = 1, 2  # the last pass: × 1/√d (thc's compress); × 1/√d, × D, the first n (decompress)


def column_passes(log: int) -> list[int]:
    """How many stages each pass after the first runs for d = 2^log: the log − 12 remaining
    stages split as evenly as passes of at most 7 allow (25: [7, 6])."""
    rest = log - HADAMARD_LOG
    if rest <= 0:
        return []
    count = -(-rest // COLUMN_LOG)
    return [rest // count + (i < rest % count) for i in range(count)]


def _hadamard(source: Tensor, signs: Tensor, factor: Tensor, out: Tensor, n: int, last: int, codes: bool) -> None:
    """The m = log2 d butterfly stages of thc.hadamard over what ``source`` holds (see
    :func:`rotate`, :func:`unrotate`) in 1 + len(column_passes(m)) passes, the last one ``last``."""
    d = signs.numel()
    log = d.bit_length() - 1
    scale = float(torch.tensor(d**-0.5, dtype=torch.float32))  # 1/√d rounded to fp32, as mul_(d**-0.5)
    columns = column_passes(log)
    work = out if last == ENCODE or not columns else torch.empty(d, dtype=torch.float32, device=out.device)
    meta = {"CODES": codes, "LAST": 0 if columns else last, "LOG": HADAMARD_LOG, **HADAMARD_META}
    grid = (-(-d // COLUMN_TILE),)
    _launch("hadamard_block", grid, source, signs, factor, work, n, d, min(log, HADAMARD_LOG), scale, **meta)
    inner = COLUMN_TILE
    for i, stages in enumerate(columns):
        meta = {"LOG": stages, "WIDTH": COLUMN_TILE >> stages, "LAST": last if i == len(columns) - 1 else 0}
        _launch("hadamard_columns", (d // COLUMN_TILE,), work, signs, out, n, inner, scale, **meta, **HADAMARD_META)
        inner <<= stages


def _check_signs(signs: Tensor, n: int) -> Tensor:
    signs = _flat(signs)
    d = signs.numel()
    if signs.dtype != torch.float32 or d & (d - 1) or not n <= d:
        raise ValueError(f"signs must be float32 of a power-of-two length d ≥ n = {n}; got {signs.dtype}, {d} elements")
    return signs


def rotate(values: Tensor, signs: Tensor) -> Tensor:
    """THC's rotation H·D·x/√d (:func:`grace_dgc.compressors.thc.hadamard` of the fp32
    ``values`` zero-padded to d = len(signs), times the ±1 ``signs``): a new fp32 tensor of d
    elements, bit for bit the torch ops' result, in 1 + ⌈(log2 d − 12)/7⌉ passes (3 for
    d = 2^25, where the torch ops take 25 stages of two reads and a write)."""
    values = _flat(values)
    if values.dtype != torch.float32:
        raise ValueError(f"rotate takes float32 values; got {values.dtype}")
    n = values.numel()
    signs = _check_signs(signs, n)
    out = torch.empty(signs.numel(), dtype=torch.float32, device=values.device)
    source = values if n else signs  # no element is read; an empty tensor's pointer may be null
    _hadamard(source, signs, signs, out, n, ENCODE, codes=False)
    return out


def unrotate(codes: Tensor, factor: Tensor, signs: Tensor, out: Tensor) -> Tensor:
    """THC's decoder: ``out`` = the first n = out.numel() elements of
    D·(H·(codes·factor)/√d), d = len(codes) = len(signs), ``codes`` int8 or int32, ``factor`` a
    0-d fp32 tensor (M/K) on their device, ``out`` a contiguous fp32 tensor (returned); each
    product rounded as torch's ``codes.to(float32).mul_(factor)`` and ``mul_(signs)`` round it."""
    codes = _flat(codes)
    if codes.dtype not in (torch.int8, torch.int32) or factor.dtype != torch.float32 or factor.numel() != 1:
        raise ValueError(
            f"unrotate takes int8 or int32 codes and a 0-d float32 factor; got {codes.dtype}, {factor.dtype}"
        )
    n = out.numel()
    signs = _check_signs(signs, n)
    if codes.numel() != signs.numel():
        raise ValueError(f"{codes.numel()} codes for {signs.numel()} signs")
    _check_out(out, n, torch.float32, codes.device)
    if n:
        _hadamard(codes, signs, factor.reshape(()).to(codes.device), out.view(-1), n, DECODE, codes=True)
    return out


CODES_BLOCK = 4096  # elements per program of stochastic_codes


def stochastic_codes(values: Tensor, uniform: Tensor, factor: Tensor, levels: int, dtype: torch.dtype) -> Tensor:
    """THC's stochastic rounding in one pass (its torch ops take nine): u = x·factor (``factor``
    a 0-d fp32 tensor, K/M or 0), NaN → 0 and clamped to [−K, K], K = ``levels``; codes
    ⌊u⌋ + (uniform < u − ⌊u⌋) as ``dtype`` (int8 or int32), a new tensor, bit for bit
    thc's ``mul``, ``nan_to_num_``, ``clamp_``, ``floor``, ``sub_``, ``lt_``, ``add_``, ``to``."""
    values, uniform = _flat(values), _flat(uniform)
    n = values.numel()
    if values.dtype != torch.float32 or uniform.dtype != torch.float32 or uniform.numel() != n:
        raise ValueError(f"stochastic_codes takes float32 values and as many float32 uniforms; got {values.dtype}")
    if dtype not in (torch.int8, torch.int32) or factor.dtype != torch.float32 or factor.numel() != 1:
        raise ValueError(f"stochastic_codes writes int8 or int32 codes with a 0-d float32 factor; got {dtype}")
    codes = torch.empty(n, dtype=dtype, device=values.device)
    if n:
        grid, factor = (-(-n // CODES_BLOCK),), factor.reshape(()).to(values.device)
        meta = {"BLOCK": CODES_BLOCK, **HADAMARD_META}
        _launch("stochastic_codes", grid, values, uniform, factor, codes, n, float(levels), **meta)
    return codes


# -- QSGD ----------------------------------------------------------------------------------------

QSGD_BLOCK = 4096  # elements per program of qsgd_codes and qsgd_values
QSGD_META = HADAMARD_META  # products rounded on their own (no FMA), as torch rounds each op
QSGD_CODES = (torch.uint8, torch.int64)  # qsgd's codes: one per byte up to 8 bits, else int64


def _check_buckets(n: int, size: int, levels: int, per_bucket: Tensor, name: str) -> Tensor:
    if not 1 <= levels <= 2**23 or size < 1:
        raise ValueError(f"QSGD takes 1 ≤ s ≤ 2**23 levels and buckets of ≥ 1 element; got s={levels}, size={size}")
    per_bucket = _flat(per_bucket)
    if per_bucket.dtype != torch.float32 or per_bucket.numel() < -(-n // size):
        raise ValueError(
            f"{name} must be float32, one per bucket of {size} ({-(-n // size)}); "
            f"got {per_bucket.dtype}, {per_bucket.numel()}"
        )
    return per_bucket


def qsgd_codes(values: Tensor, uniform: Tensor, factor: Tensor, levels: int, size: int, out: Tensor) -> Tensor:
    """QSGD's quantizer in one pass (its torch ops take ten): for the first n = out.numel()
    elements of the fp32 ``values`` (a zero-padded block of buckets of ``size``), u = |x|·f
    with f = ``factor``[i // size] (s/‖v‖ as qsgd computed it, fp32), clamped to s =
    ``levels``, and out_i = s + sgn(x_i)·(⌊u⌋ + (uniform_i < u − ⌊u⌋)) (uint8 or int64; a NaN
    u's code 0), bit for bit qsgd's torch ops; ``uniform`` (fp32, ≥ n) is read, not written."""
    values, uniform = _flat(values), _flat(uniform)
    n = out.numel()
    if values.dtype != torch.float32 or uniform.dtype != torch.float32 or min(values.numel(), uniform.numel()) < n:
        raise ValueError(
            f"qsgd_codes takes at least {n} float32 values and uniforms; got {values.dtype} "
            f"{values.numel()}, {uniform.dtype} {uniform.numel()}"
        )
    factor = _check_buckets(n, size, levels, factor, "factor")
    if out.dtype not in QSGD_CODES:
        raise ValueError(f"qsgd_codes writes uint8 or int64 codes; got {out.dtype}")
    _check_out(out, n, out.dtype, values.device)
    if n:
        grid = (-(-n // QSGD_BLOCK),)
        meta = {"BLOCK": QSGD_BLOCK, **QSGD_META}
        _launch("qsgd_codes", grid, values, uniform, factor, out.view(-1), n, min(size, n), float(levels), **meta)
    return out


def qsgd_values(codes: Tensor, scale: Tensor, levels: int, size: int, out: Tensor) -> Tensor:
    """QSGD's decoder in one pass (its torch ops take three or four): out_i = (code_i − s)·
    ``scale``[i // size] in fp32 (scale = ‖v‖/s as qsgd computed it) for n = out.numel() of
    the uint8 or int64 ``codes``, into ``out`` (a contiguous fp32 tensor, returned), bit for
    bit qsgd's cast, sub_ and mul_."""
    codes = _flat(codes)
    n = out.numel()
    if codes.dtype not in QSGD_CODES or codes.numel() < n:
        raise ValueError(f"qsgd_values takes at least {n} uint8 or int64 codes; got {codes.dtype}, {codes.numel()}")
    scale = _check_buckets(n, size, levels, scale, "scale")
    _check_out(out, n, torch.float32, codes.device)
    if n:
        grid = (-(-n // QSGD_BLOCK),)
        meta = {"BLOCK": QSGD_BLOCK, **QSGD_META}
        _launch("qsgd_values", grid, codes, scale, out.view(-1), n, min(size, n), float(levels), **meta)
    return out
