"""The fused Triton kernels (grace_dgc.kernels) against the torch ops they replace, per kernel,
as multiples of one ``copy_`` of an fp32 gradient of the same length (issue 22).

    python benchmarks/bench_kernels.py [--device cuda] [--sizes 1000000 25000000] [--repeats 7] [--ops rotate ...]

For each size n and each operation of grace_dgc.wire that has a fused kernel:

    pack k      n codes of k bits (uint8, one per byte) → ⌈n·k/8⌉ bytes     (k = 1, 2, 4)
    unpack k    the inverse, into a preallocated buffer
    pack_signs  fp32 gradient → sign bits (the sign methods' whole encoder)
    select      sign bits → ±1.0 fp32, into the gradient (the sign methods' decoder)
    ternary     fp32 gradient → twobit's 2-bit codes, packed (twobit's whole encoder)
    lookup      2-bit codes → 0/±τ fp32, into the gradient (twobit's decoder)
    onebit      1-bit SGD's compress: signs, the two groups' counts and sums (the
                fused kernel replaces the compare/count/mask passes; the sums stay torch's)
    at_least    indices and magnitudes of |x| ≥ τ, τ passing ~1 % (DGC's, top-k's and
                threshold's selection pass)
    statq       statq's compress on a GPU's path, 2 bits (torch: about fifteen passes, the bins by a
                row-wise index_add_; fused: the mean and σ stay torch's, then one read for the codes,
                their packing and each program's bin sums)
    chunk_topk  chunk_topk's compress, chunks of 4096 keeping 64 (torch: |x|, the two rounds' topk and
                gathers, a sort; fused: one program a chunk, its radix select in registers; the
                offsets' 12-bit packing stays torch's, over 1.6 % of n)
    top_k       top-k's selection of 1 % (the torch path: a sampled threshold, at_least, a selection
                among the candidates, with host reads; fused: a radix select, 4 histogram passes and
                an ordered write, no host read)
    rotate      thc's H·D·x/√d, x zero-padded to d = 2^⌈log2 n⌉ (the torch path: log2 d
                butterfly stages of an add and a sub each; fused: 1 + ⌈(log2 d − 12)/7⌉ passes)
    unrotate    thc's decoder: int8 codes × M/K, rotated back, × D, the first n into the gradient
    qsgd        qsgd's compress and decompress (s = 64, buckets of 512), the uniforms' draw and
                the bucket norms included (torch: ten elementwise ops to quantize, three or four
                to decode; fused: one pass each, the norms and the draw staying torch's)
    fp4         fp4's compress and decompress (E3M0 under a power-of-two scale; torch on a GPU: the
                elementwise frexp ops, about ten passes each way; fused: one pass each, the peak's
                aminmax staying torch's)
    terngrad    terngrad's compress and decompress, the draw, σ and the peak included (torch: about ten
                passes to encode, five to decode; fused: one each)
    natural     natural's compress and decompress, the draw included (torch: about nine integer
                passes to encode, six to decode; fused: one each)
    thc codes   thc's stochastic rounding of the rotated d-vector to int8 codes, its uniforms
                drawn beforehand (torch: nine elementwise ops; fused: one pass)

the torch path (``GRACE_DGC_KERNELS=torch``: SWAR shift-or-mask stages on a GPU, numpy on a
CPU) and the fused kernel are timed alternately with the copy_ (one warm-up round, then
``--repeats`` rounds, each sample the mean of enough calls for ~1M elements). ``x copy`` is the
minimum over the rounds divided by the copy_'s minimum; ``speed-up`` = torch / fused (minima).
Each operation's outputs are compared byte for byte first (``same``).

On a CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, which the script
sets itself before Triton is imported): the figures only show that the script works.
"""

import argparse
import os
import sys

import torch
from bench_compressors import interleaved
from timing import Report, shown_argv

from grace_dgc import kernels, wire
from grace_dgc.compressors import sparse, thc
from grace_dgc.compressors.chunk_topk import ChunkTopKCompressor
from grace_dgc.compressors.fp4 import FP4Compressor
from grace_dgc.compressors.natural import NaturalCompressor
from grace_dgc.compressors.onebit import OneBitCompressor
from grace_dgc.compressors.qsgd import QSGDCompressor
from grace_dgc.compressors.statq import StatisticalQuantizer
from grace_dgc.compressors.terngrad import TernGradCompressor
from grace_dgc.compressors.topk import exact_top_k
from grace_dgc.compressors.twobit import TwoBitCompressor
from grace_dgc.workspace import Workspace


def in_mode(mode, fn):
    """``fn`` run with the kernels' path set to ``mode`` (``GRACE_DGC_KERNELS`` at run time)."""

    def call():
        kernels.set_mode(mode)
        return fn()

    return call


def operations(n, device):
    """name → (torch-path call, fused call), each returning what it wrote (a tensor or a tuple)."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(device)
    workspace = Workspace()
    ops = {}
    for bits in (1, 2, 4):
        codes = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.uint8).to(device)
        packed = wire.pack_bits(codes, bits)
        unpacked = torch.empty(n, dtype=torch.uint8, device=device)
        ops[f"pack {bits}"] = (
            lambda c=codes, b=bits: wire.pack_bits(c, b, workspace),
            lambda c=codes, b=bits: kernels.pack(c, b),
        )
        ops[f"unpack {bits}"] = (
            lambda p=packed, b=bits: wire.unpack_bits(p, b, n, workspace),
            lambda p=packed, b=bits, u=unpacked: kernels.unpack(p, b, n, out=u),
        )
    signs = wire.pack_signs(grad)
    out = torch.empty_like(grad)
    ops["pack_signs"] = (lambda: wire.pack_signs(grad, workspace), lambda: kernels.pack_signs(grad))
    ops["select"] = (
        lambda: wire.unpack_select(signs, out, 1.0, -1.0, workspace),
        lambda: kernels.unpack_select(signs, out, 1.0, -1.0),
    )
    twobit = TwoBitCompressor(threshold=1.0)
    codes2 = kernels.pack_ternary(grad, 1.0)
    ctx = (grad.shape, grad.dtype)
    ops["ternary"] = (lambda: twobit.compress(grad, "g")[0][0], lambda: kernels.pack_ternary(grad, 1.0))
    ops["lookup"] = (
        lambda: twobit.decompress_into([codes2], ctx, out),
        lambda: kernels.unpack_lookup(codes2, 2, out, [0.0, 0.0, -1.0, 1.0]),
    )
    onebit = OneBitCompressor()
    ops["onebit"] = (lambda: tuple(onebit.compress(grad, "g")[0]), lambda: tuple(onebit.compress(grad, "g")[0]))
    tau = 2.576  # |N(0, 1)| ≥ τ for ~1 % of the elements
    ops["at_least"] = (
        lambda: sparse.at_least(grad, tau, workspace, keep_nan=False),
        lambda: kernels.at_least(grad, tau, keep_nan=False),
    )
    statq = StatisticalQuantizer()  # its whole-tensor path (a GPU's): codes and bins, then the table
    ops["statq"] = (lambda: tuple(statq._compress_elementwise(grad)), lambda: tuple(statq._compress_elementwise(grad)))
    chunked = ChunkTopKCompressor()  # its default chunk 4096, k 64: the payload (values, packed offsets)
    ops["chunk_topk"] = (lambda: tuple(chunked.compress(grad, "g")[0]), lambda: tuple(chunked.compress(grad, "g")[0]))
    top = max(1, n // 100)
    ops["top_k"] = (lambda: exact_top_k(grad, top, workspace), lambda: kernels.top_k_indices(grad, top))
    d = 1 << (n - 1).bit_length()
    diagonal = thc.rotation_signs(0, "g", 0, d, device)
    ops["rotate"] = (lambda: thc.rotate(grad, diagonal), lambda: kernels.rotate(grad, diagonal))
    rotated = kernels.rotate(grad, diagonal)
    factor = torch.tensor(7.0, device=device) / rotated.abs().amax()
    uniform = torch.rand(d, generator=gen).to(device)
    drawn = torch.empty_like(uniform)  # thc's torch path writes into its uniforms: a fresh copy each call
    ops["thc codes"] = (
        lambda: thc.stochastic_codes(rotated, drawn.copy_(uniform), factor, 7, torch.int8),
        lambda: kernels.stochastic_codes(rotated, uniform, factor, 7, torch.int8),
    )
    codes = kernels.stochastic_codes(rotated, uniform, factor, 7, torch.int8)
    ops["unrotate"] = (
        lambda: thc.unrotate(codes, factor, diagonal, out) or out,
        lambda: kernels.unrotate(codes, factor, diagonal, out),
    )
    qsgd = QSGDCompressor()  # a fresh stream per call: the same draws on either path
    decoded = torch.empty_like(grad)
    ops["qsgd"] = (
        lambda q=qsgd, g=grad, o=decoded: qsgd_round_trip(q, g, o),
        lambda q=qsgd, g=grad, o=decoded: qsgd_round_trip(q, g, o),
    )
    fp4 = FP4Compressor()
    ops["fp4"] = (lambda o=decoded: round_trip(fp4, grad, o), lambda o=decoded: round_trip(fp4, grad, o))
    for method in (TernGradCompressor(), NaturalCompressor()):
        ops[method.registered_name] = (
            lambda m=method, o=decoded: qsgd_round_trip(m, grad, o),
            lambda m=method, o=decoded: qsgd_round_trip(m, grad, o),
        )
    return grad, ops


def round_trip(compressor, grad, out):
    """A deterministic compressor's payload and the gradient it decodes to (into ``out``)."""
    payload, ctx = compressor.compress(grad, "g")
    compressor.decompress_into(payload, ctx, out)
    return (*payload, out)


def qsgd_round_trip(compressor, grad, out):
    """A stochastic compressor's payload (qsgd's, terngrad's, natural's) and the gradient it decodes
    to (into ``out``), its step reset first: each call draws the same random numbers, so the two
    paths' bytes can be compared."""
    compressor.steps.clear()
    payload, ctx = compressor.compress(grad, "g")
    compressor.decompress_into(payload, ctx, out)
    return (*payload, out)


def written(result):
    """The bytes an operation wrote (a tensor or a tuple of them), copied to the host: two
    operations writing into one buffer are compared by what each wrote."""
    tensors = result if isinstance(result, tuple) else (result,)
    return [bytes(wire.as_bytes(t).cpu().numpy()) for t in tensors]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", nargs="+", help="only these operations (e.g. rotate unrotate 'thc codes')")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("on a CPU the kernels need Triton's interpreter: run with TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"  # chosen before Triton is first imported
    report = Report()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter: not a timing)"
    report(f"fused kernels vs torch ops on {name}; torch {torch.__version__}; min of {args.repeats} rounds")
    report(f"{'op':<11} {'n':>10} {'copy_ us':>9} {'torch x copy':>13} {'fused x copy':>13} {'speed-up':>9}  same")
    try:
        for n in args.sizes:
            grad, ops = operations(n, device)
            copy_out = torch.empty_like(grad)
            inner = max(1, 1_000_000 // n)
            for op, (plain, fused) in ops.items():
                if args.ops and op not in args.ops:
                    continue
                plain, fused = in_mode("torch", plain), in_mode("triton", fused)
                same = written(plain()) == written(fused())
                times, _ = interleaved([lambda: copy_out.copy_(grad), plain, fused], device, args.repeats, inner)
                copy, torch_s, fused_s = (min(t) for t in times)
                report(
                    f"{op:<11} {n:>10} {copy * 1e6:>9.1f} {torch_s / copy:>13.2f} {fused_s / copy:>13.2f} "
                    f"{torch_s / fused_s:>9.2f}  {'yes' if same else 'NO'}"
                )
                if not same:
                    raise SystemExit(f"{op} at n={n}: the fused kernel's bytes differ from the torch path's")
    finally:
        kernels.set_mode(None)
    report(f"command: python benchmarks/bench_kernels.py {' '.join(shown_argv(argv))}")


if __name__ == "__main__":
    main()
