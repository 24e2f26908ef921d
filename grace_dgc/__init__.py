"""grace_dgc: gradient compression for distributed PyTorch training.

grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.01)
optimizer = grace_dgc.DistributedOptimizer(optimizer, grace, model.named_parameters())
"""

from . import communicators, compressors, memories  # noqa: F401  (register the built-ins)
from .compat import grace_from_params as from_params  # GRACE's dict and defaults: compat owns them
from .engines import create_engine
from .errors import GraceCommError, GraceConfigError
from .grace import Grace
from .interfaces import Communicator, Compressor, Memory
from .registry import (
    build,
    list_communicators,
    list_compressors,
    list_memories,
    register_communicator,
    register_compressor,
    register_memory,
)
from .training import schedules  # noqa: F401  (grace_dgc.schedules.create(...))
from .training.checkpoint import PerRankState, gather_state, load_gathered_state
from .training.ddp import ddp_comm_hook
from .training.fsdp import FSDPCompression, fsdp_compression
from .training.optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from .training.schedules import (
    DiLoCo,
    LocalSGD,
    OneBitAdam,
    OuterSync,
    SparseLoCo,
    StreamingDiLoCo,
    ZeroOneAdam,
    list_schedules,
    register_schedule,
    sparseloco_grace,
    streaming_grace,
)

__version__ = "0.1.0"

__all__ = [
    "Grace",
    "build",
    "from_params",
    "Compressor",
    "Memory",
    "Communicator",
    "DistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "list_compressors",
    "list_memories",
    "list_communicators",
    "register_compressor",
    "register_memory",
    "register_communicator",
    "create_engine",
    "GraceConfigError",
    "GraceCommError",
    "ddp_comm_hook",
    "fsdp_compression",
    "FSDPCompression",
    "gather_state",
    "PerRankState",
    "load_gathered_state",
    "OuterSync",
    "DiLoCo",
    "LocalSGD",
    "SparseLoCo",
    "sparseloco_grace",
    "StreamingDiLoCo",
    "streaming_grace",
    "OneBitAdam",
    "ZeroOneAdam",
    "list_schedules",
    "register_schedule",
]
