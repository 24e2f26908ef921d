"""Synchronization schedules: *when* and *what* a :class:`~grace_dgc.grace.Grace` exchanges.

A :class:`~grace_dgc.training.optimizer.DistributedOptimizer` exchanges every gradient at every step.
A schedule exchanges rarely and something else: DiLoCo and local SGD run ``inner_steps``
steps of a local optimizer with no communication at all, then exchange the *outer gradient*
(how far each rank moved since the last synchronization) through the Grace — any compressor,
memory and communicator, error feedback included — and apply the average with an outer
optimizer. Streaming DiLoCo's quantized outer gradient is a Grace with a quantizing
compressor; MuLoCo's compressed delta with error feedback is a Grace with ``residual`` memory.

Schedules are registered by name like the parts (``@register_schedule("name")``, the
entry-point group ``grace_dgc.schedules``) and built with :func:`create`::

    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.1)
    grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)  # ranks start alike
    opt = grace_dgc.schedules.create(
        "diloco", torch.optim.AdamW(model.parameters(), lr=4e-4), grace, model.named_parameters(), inner_steps=500
    )
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()  # a local AdamW step; every 500th also synchronizes
    opt.synchronize_now()  # the last partial round, before evaluating or saving
"""

from .adam import OneBitAdam, ZeroOneAdam
from .outer import DiLoCo, LocalSGD, OuterSync, SparseLoCo, sparseloco_grace
from .registry import SCHEDULES, accepted_params, create, list_schedules, register_schedule
from .streaming import StreamingDiLoCo, streaming_grace

__all__ = [
    "SCHEDULES",
    "register_schedule",
    "list_schedules",
    "accepted_params",
    "create",
    "OuterSync",
    "DiLoCo",
    "LocalSGD",
    "SparseLoCo",
    "sparseloco_grace",
    "StreamingDiLoCo",
    "streaming_grace",
    "OneBitAdam",
    "ZeroOneAdam",
]
