import hashlib
import math
import sys

import torch
import torch.distributed as dist

from .. import wire
from ..errors import check_range
from ..interfaces import Compressor
from ..registry import register_compressor


def process_rank():
    """This process's rank: Horovod's once hvd.init() ran, else torch.distributed's, else 0."""
    hvd = sys.modules.get("horovod.torch")
    try:
        if hvd is not None and hvd.is_initialized():
            return hvd.rank()
    except Exception:   # noqa: BLE001  horovod present but its library failed to load
        pass
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class StochasticCompressor(Compressor):
    """Base of the stochastic-rounding compressors (qsgd, terngrad, natural): own random streams.

    The t-th compression of tensor ``name`` draws from a fresh ``torch.Generator`` on the
    tensor's device seeded with blake2b(seed + rank, name, t). Hence:
      * the global RNG is never touched, and CUDA tensors get CUDA randoms;
      * ranks round independently (the papers' variance bounds assume independent
        quantisers), yet rank r with ``seed=s`` draws exactly what rank 0 with ``seed=s+r``
        draws — that is how a test reproduces another rank locally;
      * the state is just t per name, equal on all ranks, so loading one rank's
        checkpoint on every rank resumes each rank's own stream exactly.
    rank is Horovod's rank after hvd.init(), else the default torch.distributed group's,
    else 0 (a single process).
    """

    def __init__(self, seed=0):
        self.seed = check_range("seed", seed, 0, kind=int)
        self.steps = {}     # name -> how many times that tensor was compressed

    def generator(self, name, device):
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        key = f"{self.seed + process_rank()}\0{name}\0{step}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)

    def sent_mask(self, payload, ctx):
        """Every element travels (a level, ternary or power of two; a rounded 0 included)."""
        return torch.ones(ctx[0], dtype=torch.bool, device=payload[0].device)

    def state_dict(self):
        return {"steps": dict(self.steps)}

    def load_state_dict(self, state):
        self.steps = dict(state["steps"])


def stochastic_round_(x, generator):
    """⌊x⌋ + Bernoulli(x − ⌊x⌋) for x ≥ 0: an unbiased integer, E = x. Overwrites x."""
    floor = x.floor()
    fraction = x.sub_(floor)
    uniform = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return floor.add_(uniform.lt_(fraction))     # in place: large tensors, few passes


@register_compressor("qsgd")
class QSGDCompressor(StochasticCompressor):
    """QSGD (Alistarh et al. 2017): unbiased stochastic levels, ⌈log2(2s+1)⌉ bits/element + bucket norms.

    s = ``quantum_num`` levels, per bucket of ``bucket_size`` elements (the last bucket may
    be shorter):

        Q_s(v_i) = ‖v‖₂ · sgn(v_i) · ξ_i(v, s) / s,
        ξ_i = l + 1 with probability |v_i|/‖v‖₂ · s − l, else l,   l = ⌊|v_i|/‖v‖₂ · s⌋,

    so E[Q_s(v)] = v (unbiased), Var ≤ min(n/s², √n/s)·‖v‖² per bucket (paper, Lemma 3.1).

    Wire: the signed level sgn(v_i)·ξ_i ∈ [−s, s], offset by +s, packed into
    b = ⌈log2(2s+1)⌉ bits per element (wire.pack_bits), plus one fp32 ‖v‖₂ per bucket:
    ⌈n·b/8⌉ + 4·⌈n/bucket_size⌉ bytes. Default s = 64 (GRACE's default; b = 8); s = 127 is
    the finest that still fits 8 bits. A bucket of zeros sends norm 0 and levels 0.
    """

    def __init__(self, quantum_num=64, bucket_size=512, seed=0):
        super().__init__(seed)
        # levels are exact integers in the fp32 arithmetic below only up to 2**24
        self.quantum_num = check_range("quantum_num", quantum_num, 1, 2 ** 23, kind=int)
        self.bucket_size = check_range("bucket_size", bucket_size, 1, kind=int)
        self.bits = math.ceil(math.log2(2 * self.quantum_num + 1))

    def buckets(self, flat):
        """``flat`` as rows of ``bucket_size``, zero-padded (a copy only when padding)."""
        padding = (-flat.numel()) % self.bucket_size
        return (torch.nn.functional.pad(flat, (0, padding)) if padding else flat).view(-1, self.bucket_size)

    def compress(self, tensor, name):
        flat = tensor.reshape(-1).float()
        n, s = flat.numel(), self.quantum_num
        buckets = self.buckets(flat)
        norms = buckets.norm(dim=1)
        # a zero-norm bucket has only zeros: divide by 1 instead (levels stay 0)
        scaled = buckets.abs().mul_((s / torch.where(norms > 0, norms, 1.0)).unsqueeze(1))
        levels = stochastic_round_(scaled.clamp_(max=s), self.generator(name, tensor.device))
        codes = torch.copysign(levels, buckets).add_(s).reshape(-1)[:n]     # in [0, 2s]
        codes = codes.to(torch.uint8 if self.bits <= 8 else torch.int64)
        return [wire.pack_bits(codes, self.bits), norms], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        packed, norms = payload
        shape, dtype = ctx
        n, s = torch.Size(shape).numel(), self.quantum_num
        signed = self.buckets(wire.unpack_bits(packed, self.bits, n).float().sub_(s))
        values = signed.mul_((norms / s).unsqueeze(1))
        return values.reshape(-1)[:n].to(dtype).view(shape)
