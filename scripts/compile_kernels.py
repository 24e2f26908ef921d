"""Compile every variant of the fused Triton kernels that grace_dgc launches, for NVIDIA GPU
targets, on a machine without a GPU.

    python scripts/compile_kernels.py [--arch 90 80] [--wide]

It uses Triton's ahead-of-time path (Triton IR → GPU IR → LLVM → PTX → a cubin from the ptxas
Triton ships), which needs no driver. The tests run the kernels under Triton's interpreter on
a CPU (tests/core/test_kernels.py), which proves their arithmetic but not that they compile: a
construct the interpreter accepts may not compile, or may compile differently. This script
closes that gap before a GPU is lent. It exits 1, naming each variant that failed and why.

The variants mirror grace_dgc/kernels/__init__.py's launches: each kernel with every dtype, mode, bit
width and flag its wrappers pass, and n as a 32-bit integer, or 64-bit with ``--wide``.
Architectures: 90 (H100, H200), 80 (A100); any other that the installed Triton supports.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
C = "constexpr"


def variants(n_type):
    """(kernel name, signature, constexprs) of every launch in grace_dgc/kernels/__init__.py."""
    from grace_dgc import kernels

    block, select_block = kernels.BLOCK, kernels.SELECT_BLOCK
    found = []
    pack = {"source": None, "out": "*u8", "n": n_type, "tau_bits": "i32"}
    pack |= {"BITS": C, "PER": C, "MODE": C, "ABS": C, "INF": C, "BLOCK": C}
    for bits in (1, 2, 4):  # pack(), unpack()
        meta = {"BITS": bits, "PER": 8 // bits, "MODE": kernels.CODES, "ABS": 0, "INF": 0, "BLOCK": block}
        found.append(("pack", dict(pack, source="*u8"), meta))
        unpack = {"packed": "*u8", "out": "*u8", "n": n_type, "BITS": C, "PER": C, "BLOCK": C}
        found.append(("unpack", unpack, {"BITS": bits, "PER": 8 // bits, "BLOCK": block}))
    for integer, magnitude_mask, infinity in kernels._LAYOUT.values():
        word = {torch.int16: "*i16", torch.int32: "*i32"}[integer]
        limits = {"ABS": magnitude_mask, "INF": infinity}
        for mode, bits in ((kernels.SIGNS, 1), (kernels.TERNARY, 2)):  # pack_signs(), pack_ternary()
            meta = {"BITS": bits, "PER": 8 // bits, "MODE": mode, **limits, "BLOCK": block}
            found.append(("pack", dict(pack, source=word), meta))
        for keep_nan in (True, False):  # at_least()
            count = {"source": word, "counts": "*i32", "n": n_type, "tau_bits": "i32"}
            count |= {"KEEP_NAN": C, "ABS": C, "INF": C, "BLOCK": C}
            meta = {"KEEP_NAN": keep_nan, **limits, "BLOCK": select_block}
            found.append(("count", count, meta))
            compact = {"source": word, "starts": "*i64", "indices": "*i64", "magnitudes": word}
            compact |= {"n": n_type, "tau_bits": "i32", "KEEP_NAN": C, "ABS": C, "INF": C, "BLOCK": C}
            found.append(("compact", compact, meta))
    split = {"source_bits": "*i32", "packed": "*u8", "picked": "*i32", "counts": "*i32"}
    found.append(("sign_split", split | {"n": n_type, "BLOCK": C}, {"BLOCK": block}))
    for bits in (1, 2):  # unpack_lookup()
        lookup = {"packed": "*u8", "out": "*i32", "n": n_type, "v0": "i32", "v1": "i32", "v2": "i32", "v3": "i32"}
        found.append(
            ("lookup", lookup | {"BITS": C, "PER": C, "BLOCK": C}, {"BITS": bits, "PER": 8 // bits, "BLOCK": block})
        )
        table = {"packed": "*u8", "out": "*i32", "n": n_type, "table": "*i32", "BITS": C, "PER": C, "BLOCK": C}
        found.append(("lookup_table", table, {"BITS": bits, "PER": 8 // bits, "BLOCK": block}))
    for codes, source in ((False, "*fp32"), (True, "*i8"), (True, "*i32")):  # rotate(), unrotate()
        block = {"source": source, "signs": "*fp32", "factor": "*fp32", "out": "*fp32", "n": n_type, "d": n_type}
        block |= {"live": "i32", "scale": "fp32", "CODES": C, "LAST": C, "LOG": C}
        for last in (0, kernels.DECODE if codes else kernels.ENCODE):
            found.append(("hadamard_block", block, {"CODES": codes, "LAST": last, "LOG": kernels.HADAMARD_LOG}))
    columns = {"work": "*fp32", "signs": "*fp32", "out": "*fp32", "n": n_type, "inner": n_type, "scale": "fp32"}
    columns |= {"LOG": C, "WIDTH": C, "LAST": C}
    for stages in range(1, kernels.COLUMN_LOG + 1):
        for last in (0, kernels.ENCODE, kernels.DECODE):
            meta = {"LOG": stages, "WIDTH": kernels.COLUMN_TILE >> stages, "LAST": last}
            found.append(("hadamard_columns", columns, meta))
    for word in ("*i8", "*i32"):  # stochastic_codes()
        quantize = {"values": "*fp32", "uniform": "*fp32", "factor": "*fp32", "codes": word, "n": n_type}
        found.append(("stochastic_codes", quantize | {"levels": "fp32", "BLOCK": C}, {"BLOCK": kernels.CODES_BLOCK}))
    for word in ("*u8", "*i64"):  # qsgd_codes(), qsgd_values(): codes of up to 8 bits, or wider
        buckets = {"n": n_type, "size": n_type, "levels": "fp32", "BLOCK": C}
        meta = {"BLOCK": kernels.QSGD_BLOCK}
        codes = {"values": "*fp32", "uniform": "*fp32", "factor": "*fp32", "codes": word}
        found.append(("qsgd_codes", codes | buckets, meta))
        found.append(("qsgd_values", {"codes": word, "scale": "*fp32", "out": "*fp32"} | buckets, meta))
    keys = {f"k{r}": "i32" for r in range(6)}  # random_indices(): 31-bit keys
    indices = {"out": "*i64", "k": n_type, "n": n_type, "a": "i32", "b": "i32", "mask_a": "i32", "mask_b": "i32"}
    found.append(("random_indices", indices | keys | {"m32": "i64", "BLOCK": C}, {"BLOCK": kernels.RANDOM_BLOCK}))
    for block in (1, 256, 4096):  # fp8_encode(), fp8_decode(): the tile of a few block sizes
        tile = kernels._fp8_tile(block)
        for mantissa, bias, saturate, _ in kernels.FP8_FORMATS.values():
            encode = {"values": "*fp32", "codes": "*u8", "scales": "*fp32", "n": n_type, "blocks": n_type}
            encode |= {"size": "i32", "largest": "fp32", "MANT": C, "BIAS": C, "SATURATE": C, "ROWS": C, "COLS": C}
            found.append(("fp8_encode", encode, {"MANT": mantissa, "BIAS": bias, "SATURATE": saturate, **tile}))
        decode = {"codes": "*u8", "scales": "*fp32", "table": "*fp32", "out": "*fp32", "n": n_type}
        found.append(("fp8_decode", decode | {"blocks": n_type, "size": "i32", "ROWS": C, "COLS": C}, tile))
    for name, first, second in (("fp4_encode", "values", "packed"), ("fp4_decode", "packed", "out")):
        words = {"values": "*fp32", "packed": "*u8", "out": "*fp32"}
        signature = {first: words[first], "scale": "*fp32", second: words[second], "n": n_type, "BLOCK": C}
        found.append((name, signature, {"BLOCK": kernels.FP4_BLOCK}))
    for integer, magnitude_mask, infinity in kernels._LAYOUT.values():  # top_k_indices(): its radix passes
        word = {torch.int16: "*i16", torch.int32: "*i32"}[integer]
        limits = {"ABS": magnitude_mask, "INF": infinity, "BLOCK": kernels.TOP_BLOCK}
        for shift in range(8 * torch.tensor([], dtype=integer).element_size() - 8, -1, -8):
            histogram = {"source": word, "state": "*i32", "hist": "*i32", "n": n_type, "SHIFT": C}
            found.append(("radix_histogram", histogram | {"ABS": C, "INF": C, "BLOCK": C}, {"SHIFT": shift, **limits}))
            found.append(("radix_pick", {"hist": "*i32", "state": "*i32", "SHIFT": C}, {"SHIFT": shift}))
        count = {"source": word, "state": "*i32", "greater": "*i32", "tied": "*i32", "n": n_type}
        found.append(("top_count", count | {"ABS": C, "INF": C, "BLOCK": C}, limits))
        compact = {"source": word, "state": "*i32", "greater_before": "*i64", "tied_before": "*i64"}
        compact |= {"indices": "*i64", "n": n_type, "ABS": C, "INF": C, "BLOCK": C}
        found.append(("top_compact", compact, limits))
        chunked = {"source": word, "values": word, "offsets": "*i64", "C": "i32", "K": "i32"}
        chunked |= {"ABS": C, "INF": C, "WIDTH": C, "BLOCK": C}
        width = 8 * torch.tensor([], dtype=integer).element_size()
        for block in (64, 4096, kernels.CHUNK_TOP_LARGEST):  # chunk_top_k(): a chunk per program
            meta = {"ABS": magnitude_mask, "INF": infinity, "WIDTH": width, "BLOCK": block}
            found.append(("chunk_top_k", chunked, meta))
    for bits in (1, 2, 4, 8):  # statq_encode()
        statq = {"values": "*fp32", "shift": "*fp32", "scale": "*fp32", "packed": "*u8", "sums": "*fp64"}
        statq |= {"counts": "*i32", "n": n_type, "BITS": C, "PER": C, "LEVELS": C, "BLOCK": C}
        meta = {"BITS": bits, "PER": 8 // bits, "LEVELS": 1 << bits, "BLOCK": kernels.STATQ_ELEMENTS // (8 // bits)}
        found.append(("statq_encode", statq, meta))
    terngrad = {"values": "*fp32", "uniform": "*fp32", "bound": "*fp32", "divisor": "*fp32", "packed": "*u8"}
    found.append(("terngrad_encode", terngrad | {"n": n_type, "BLOCK": C}, {"BLOCK": kernels.BLOCK}))
    natural = {"bits": "*i32", "draws": "*i32", "exponents": "*u8", "signs": "*u8", "n": n_type, "BLOCK": C}
    found.append(("natural_encode", natural, {"BLOCK": kernels.BLOCK}))
    natural = {"exponents": "*u8", "signs": "*u8", "out": "*i32", "n": n_type, "BLOCK": C}
    found.append(("natural_decode", natural, {"BLOCK": kernels.BLOCK}))
    return found


def options(name):
    """The compile options a launch of kernel ``name`` passes (thc's and qsgd's: no FMA contraction)."""
    from grace_dgc import kernels

    if name.startswith("qsgd"):
        return dict(kernels.QSGD_META)
    return dict(kernels.HADAMARD_META) if name.startswith(("hadamard", "stochastic")) else {}


def compile_for(arch, only, wide):
    """Compile every variant for compute capability ``arch``: (variants tried, failures named)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(ROOT))
    from grace_dgc.kernels import triton as triton_kernels

    failures, count = [], 0
    target = GPUTarget("cuda", arch, 32)
    for n_type in ["i32", "i64"] if wide else ["i32"]:
        for name, signature, constants in variants(n_type):
            if not name.startswith(only):
                continue
            label = f"sm_{arch} {name} {', '.join(f'{k}={v}' for k, v in constants.items())} " + " ".join(
                f"{k}:{v}" for k, v in signature.items() if v != C
            )
            fn = getattr(triton_kernels, f"{name}_kernel")
            try:
                source = ASTSource(fn, signature, constexprs=constants)
                compiled = triton.compile(source, target=target, options=options(name))
                if "cubin" not in compiled.asm:
                    raise RuntimeError("no cubin produced")
            except Exception as error:  # every variant is tried; each failure is named
                failures.append(f"{label}: {type(error).__name__}: {str(error).strip()[:2000]}")
                print(f"FAILED {label}", flush=True)
            count += 1
    return count, failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90: H100)")
    parser.add_argument("--only", default="", help="compile only the kernels whose name starts with this")
    parser.add_argument("--wide", action="store_true", help="also n as a 64-bit integer (tensors of 2^31+ elements)")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="architectures compiled at once (default: the cores)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled; unset it")
    started = time.monotonic()
    # one process per architecture: a compile is mostly ptxas and MLIR passes, one core each
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.jobs, len(args.arch)))) as pool:
        done = list(pool.map(compile_for, args.arch, [args.only] * len(args.arch), [args.wide] * len(args.arch)))
    count = sum(c for c, _ in done)
    failures = [f for _, fs in done for f in fs]
    print(f"{count - len(failures)} of {count} kernel variants compiled ({time.monotonic() - started:.0f} s)")
    for failure in failures:
        print(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
