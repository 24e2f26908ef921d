"""GRACE compatibility: a GRACE script runs with only its import lines changed.

    from grace_dl.dist.helper import grace_from_params        → from grace_dgc.compat import grace_from_params
    from grace_dl.torch.helper import grace_from_params       → from grace_dgc.compat import grace_from_params
    from grace_dl.dist.communicator.allgather import Allgather → from grace_dgc.compat import Allgather
    from grace_dl.dist.compressor.topk import TopKCompressor   → from grace_dgc.compat import TopKCompressor
    from grace_dl.dist.memory.residual import ResidualMemory   → from grace_dgc.compat import ResidualMemory
    import horovod.torch as hvd   (GRACE's patched Horovod)    → import grace_dgc.compat.horovod as hvd

What this maps (each entry is tested in tests/scripts/test_compat.py):

* GRACE's defaults, not grace_dgc's: topk/randomk/dgc ``compress_ratio`` 0.3, qsgd
  ``quantum_num`` 127 with ``bucket_size`` 128 (GRACE's torch.distributed helper), efsignsgd
  ``lr`` 0.1, signum and the dgc memory ``momentum`` 0.9, threshold 0.01, powersgd rank 1.
* GRACE's names: ``qsgd_cuda``/``natural_cuda`` are the same methods (registry aliases: the
  vectorised torch code runs on CUDA already); memory ``dgc`` is ``momentum``; communicator
  ``alltoall`` is ``reduce_scatter`` (see below).
* GRACE's keys: ``world_size`` (checked against the engine at the first exchange and
  returned by ``grace.world_size`` before it), ``kernel`` ('torch', 'cupy', 'rdxtopk': all
  compute the exact top-k here), ``gradient_clipping`` True/False (see below). A GRACE key
  that the chosen methods do not use is ignored with a warning, as GRACE ignores it; any
  other unknown key is an error.
* GRACE's constructors (``Allgather(TopKCompressor(0.3), ResidualMemory(), world_size)``):
  functions of the same names and signatures returning grace_dgc parts; a communicator
  returns a :class:`~grace_dgc.Grace`, whose ``step(tensor, name)`` returns the average.

Where GRACE contradicts the paper, grace_dgc follows the paper:

* Aggregation is the average of the decompressed payloads (GRACE's ``Allreduce`` sums the
  *encoded* payloads, which for qsgd, terngrad, topk … is not the method): a compressor whose
  payloads cannot be summed given ``allreduce`` travels by ``allgather``.
* ``alltoall`` is GRACE's reduce-scatter: chunks to their owners, each owner sums and
  re-quantises its chunk, the chunks are gathered. GRACE drops the re-quantisation error;
  here it maps to ``reduce_scatter``, whose owners keep it (error feedback, see its
  docstring). For compressors that cannot be chunked (GRACE: ``NotImplementedError``
  beyond qsgd, terngrad, natural) the exact average travels by ``allgather``.
* ``gradient_clipping=True``: GRACE clamps each element to the root-mean-square over ranks
  of the tensor's norm (an element never exceeds its own tensor's norm, so it rarely acts);
  DGC (Lin et al. 2018, §3.2) clips the local gradient's norm at a threshold scaled by
  N^-1/2. True selects the paper's clipping with threshold :data:`GRACE_CLIP_NORM`; a number
  selects that threshold.
* Sign methods: an exact zero is sent as +1 and a majority tie gives 0 (GRACE: +1); see
  docs/decisions.md, "Sign methods".
"""

import logging
import warnings
import weakref
from typing import Any

import numpy as np

from ..engines import create_engine
from ..engines.base import Engine
from ..errors import GraceConfigError, check_range
from ..grace import Grace
from ..interfaces import Compressor, Memory
from ..registry import COMMUNICATORS, COMPRESSORS, MEMORIES, Registry, build

log = logging.getLogger("grace_dgc")

#: the clipping threshold ``gradient_clipping=True`` selects (scaled by N^-1/2 per rank)
GRACE_CLIP_NORM = 5.0

#: GRACE's helper defaults, by grace_dgc's canonical names
GRACE_DEFAULTS: dict[str, dict[str, dict[str, object]]] = {
    "compressor": {
        "topk": {"compress_ratio": 0.3},
        "randomk": {"compress_ratio": 0.3},
        "dgc": {"compress_ratio": 0.3},
        "qsgd": {"quantum_num": 127, "bucket_size": 128},
        "threshold": {"threshold": 0.01},
        "signum": {"momentum": 0.9},
        "powersgd": {"compress_rank": 1},
    },
    "memory": {"momentum": {"momentum": 0.9}, "efsignsgd": {"lr": 0.1}},
}
#: every key GRACE's grace_from_params reads
GRACE_KEYS = {
    "compressor",
    "memory",
    "communicator",
    "world_size",
    "compress_ratio",
    "lr",
    "quantum_num",
    "bucket_size",
    "momentum",
    "threshold",
    "kernel",
    "gradient_clipping",
    "compress_rank",
}
#: GRACE's top-k kernels; all give the exact top-k here
GRACE_KERNELS = ("torch", "cupy", "rdxtopk")
#: build() keywords a dict may also carry
NATIVE_KEYS = ("engine", "process_group", "timeout", "nonfinite")

_made_with: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # part -> the parameters its constructor was given


def grace_from_params(params: dict[str, Any], engine: str | Engine = "auto") -> Grace:
    """GRACE's ``grace_from_params``: a :class:`~grace_dgc.Grace` from GRACE's dict, with
    GRACE's defaults and keys (module docstring). Keys whose value is None are absent."""
    if not isinstance(params, dict):
        raise GraceConfigError(f"grace_from_params needs a dict, got {type(params).__name__}")
    params = {key: value for key, value in params.items() if value is not None}
    native = {key: params.pop(key) for key in NATIVE_KEYS if key in params}
    native.setdefault("engine", engine)
    compressor = COMPRESSORS.canonical(params.pop("compressor", "none"))
    memory = MEMORIES.canonical(params.pop("memory", "none"))
    communicator = _carrier(params.pop("communicator", "allreduce"), compressor)
    world_size = params.pop("world_size", None)
    _check_kernel(params.pop("kernel", "torch"))
    if "gradient_clipping" in params:
        params["gradient_clipping"] = _clipping(params["gradient_clipping"])
    settings = {
        **GRACE_DEFAULTS["compressor"].get(compressor, {}),
        **GRACE_DEFAULTS["memory"].get(memory, {}),
        **params,
    }
    accepted = {
        *COMPRESSORS.accepted_params(compressor),
        *MEMORIES.accepted_params(memory),
        *COMMUNICATORS.accepted_params(communicator),
    }
    for key in sorted(set(settings) - accepted):
        if key in GRACE_KEYS:  # GRACE reads a key only for the methods that use it
            if key in params:
                warnings.warn(
                    f"grace_dgc.compat: {key}={params[key]!r} is not used by compressor "
                    f"{compressor!r} / memory {memory!r}; ignored (as GRACE does)",
                    stacklevel=2,
                )
            del settings[key]
    return build(compressor, memory, communicator, world_size=world_size, **native, **settings)


def _carrier(name: object, compressor: str) -> str:
    """GRACE's communicator name → the grace_dgc communicator that carries ``compressor``."""
    if not isinstance(name, str):
        raise GraceConfigError(f"communicator must be given by name (a str), got {name!r}")
    wanted = "reduce_scatter" if name.lower() in ("alltoall", "all_to_all") else COMMUNICATORS.canonical(name)
    reason = COMMUNICATORS.get(wanted).refusal(COMPRESSORS.get(compressor)())
    if reason:
        log.info("grace_dgc.compat: %s cannot carry %s (%s); it travels by allgather", name, compressor, reason)
        wanted = "allgather"
    return wanted


def _check_kernel(kernel: object) -> None:
    if kernel not in GRACE_KERNELS:
        raise GraceConfigError(
            f"kernel={kernel!r}; accepted: {', '.join(GRACE_KERNELS)} (all compute the exact top-k in grace_dgc)"
        )


def _clipping(value: object) -> float | None:
    if isinstance(value, (bool, np.bool_)):  # numpy's booleans too
        return GRACE_CLIP_NORM if value else None
    return check_range("gradient_clipping", value, 0, low_open=True)


# -- GRACE's constructors -------------------------------------------------------------
def _part(registry: Registry, name: str, **params: object) -> Any:
    part = registry.get(name)(**params)
    _made_with[part] = params
    return part


def NoneCompressor() -> Compressor:
    return _part(COMPRESSORS, "none")


def FP16Compressor() -> Compressor:
    return _part(COMPRESSORS, "fp16")


def TopKCompressor(compress_ratio: float = 0.3, kernel: str = "torch") -> Compressor:
    _check_kernel(kernel)
    return _part(COMPRESSORS, "topk", compress_ratio=compress_ratio)


def RandomKCompressor(compress_ratio: float = 0.3) -> Compressor:
    return _part(COMPRESSORS, "randomk", compress_ratio=compress_ratio)


def DgcCompressor(compress_ratio: float = 0.3) -> Compressor:
    return _part(COMPRESSORS, "dgc", compress_ratio=compress_ratio)


def ThresholdCompressor(threshold: float = 0.01) -> Compressor:
    return _part(COMPRESSORS, "threshold", threshold=threshold)


def QSGDCompressor(quantum_num: int = 127, bucket_size: int = 128) -> Compressor:
    return _part(COMPRESSORS, "qsgd", quantum_num=quantum_num, bucket_size=bucket_size)


def TernGradCompressor() -> Compressor:
    return _part(COMPRESSORS, "terngrad")


def NaturalCompressor() -> Compressor:
    return _part(COMPRESSORS, "natural")


QSGDCompressor_CUDA = QSGDCompressor  # GRACE's CUDA kernels: the same methods here
NaturalCompressor_CUDA = NaturalCompressor


def OneBitCompressor() -> Compressor:
    return _part(COMPRESSORS, "onebit")


def SignSGDCompressor() -> Compressor:
    return _part(COMPRESSORS, "signsgd")


def SignumCompressor(momentum: float = 0.9) -> Compressor:
    return _part(COMPRESSORS, "signum", momentum=momentum)


def EFSignSGDCompressor(lr: float = 0.1) -> Compressor:
    """GRACE divides the aggregate by ``lr`` here and multiplies by it in the memory; in
    grace_dgc the memory carries ``lr`` alone (give the same lr to EFSignSGDMemory)."""
    check_range("lr", lr, 0, low_open=True)
    return _part(COMPRESSORS, "efsignsgd")


def PowerSGDCompressor(compress_rank: int = 1) -> Compressor:
    part = _part(COMPRESSORS, "powersgd", compress_rank=compress_rank)
    part.q_memory = part  # GRACE hands compressor.q_memory to PowerSGDMemory: Q lives here
    return part


def NoneMemory() -> Memory:
    return _part(MEMORIES, "none")


def ResidualMemory(beta: float = 1.0, gamma: float = 1.0) -> Memory:
    return _part(MEMORIES, "residual", beta=beta, gamma=gamma)


def DgcMemory(momentum: float = 0.9, gradient_clipping: bool | float = False, world_size: int | None = None) -> Memory:
    """GRACE's DGC memory: grace_dgc's ``momentum`` memory (``world_size`` comes from the
    engine; ``gradient_clipping`` as in the module docstring)."""
    return _part(MEMORIES, "momentum", momentum=momentum, gradient_clipping=_clipping(gradient_clipping))


def PowerSGDMemory(q_memory: Any = None, compress_rank: int = 1) -> Memory:
    """``q_memory`` is GRACE's shared Q store: the PowerSGDCompressor that owns Q here; its
    rank is set to ``compress_rank`` as GRACE's memory decides the rank."""
    rank = check_range("compress_rank", compress_rank, 1, kind=int)
    if q_memory is not None:
        if getattr(q_memory, "registered_name", None) != "powersgd":
            raise GraceConfigError(
                f"PowerSGDMemory(q_memory, …) needs the PowerSGDCompressor()'s q_memory, got {type(q_memory).__name__}"
            )
        q_memory.compress_rank = rank
        _made_with[q_memory] = {"compress_rank": rank}
    return _part(MEMORIES, "powersgd")


def EFSignSGDMemory(lr: float = 0.1) -> Memory:
    return _part(MEMORIES, "efsignsgd", lr=lr)


def _compose(communicator: str, compressor: Compressor, memory: Memory, world_size: int | None) -> Grace:
    for what, part, base in (("compressor", compressor, Compressor), ("memory", memory, Memory)):
        if not isinstance(part, base):
            raise GraceConfigError(
                f"the {what} must be a grace_dgc {base.__name__} (e.g. from grace_dgc.compat), "
                f"got {type(part).__name__}"
            )
    name = _carrier(communicator, compressor.registered_name)
    engine = create_engine("auto")
    grace = Grace(compressor, memory, COMMUNICATORS.get(name)(engine), engine, world_size=world_size)
    grace.params = {
        "compressor": dict(_made_with.get(compressor, {})),
        "memory": dict(_made_with.get(memory, {})),
        "communicator": {},
    }
    return grace


def Allreduce(compressor: Compressor, memory: Memory, world_size: int | None = None) -> Grace:
    return _compose("allreduce", compressor, memory, world_size)


def Allgather(compressor: Compressor, memory: Memory, world_size: int | None = None) -> Grace:
    return _compose("allgather", compressor, memory, world_size)


def Broadcast(compressor: Compressor, memory: Memory, world_size: int | None = None) -> Grace:
    return _compose("broadcast", compressor, memory, world_size)


def AllToAll(compressor: Compressor, memory: Memory, world_size: int | None = None) -> Grace:
    return _compose("alltoall", compressor, memory, world_size)


__all__ = [
    "grace_from_params",
    "GRACE_CLIP_NORM",
    "GRACE_DEFAULTS",
    "Allreduce",
    "Allgather",
    "Broadcast",
    "AllToAll",
    "NoneCompressor",
    "FP16Compressor",
    "TopKCompressor",
    "RandomKCompressor",
    "DgcCompressor",
    "ThresholdCompressor",
    "QSGDCompressor",
    "QSGDCompressor_CUDA",
    "TernGradCompressor",
    "NaturalCompressor",
    "NaturalCompressor_CUDA",
    "OneBitCompressor",
    "SignSGDCompressor",
    "SignumCompressor",
    "EFSignSGDCompressor",
    "PowerSGDCompressor",
    "NoneMemory",
    "ResidualMemory",
    "DgcMemory",
    "PowerSGDMemory",
    "EFSignSGDMemory",
]
