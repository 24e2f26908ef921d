"""GRACE's patched ``horovod.torch``, without patching Horovod: ``import grace_dgc.compat.horovod as hvd``.

Everything is stock ``horovod.torch`` except :func:`DistributedOptimizer`, which takes
GRACE's second argument, the ``grc`` object, as GRACE's patched Horovod does:

    optimizer = hvd.DistributedOptimizer(optimizer, grc, named_parameters=model.named_parameters())
"""

from collections.abc import Iterable

import torch
from horovod.torch import *  # noqa: F403  (the stock API, as GRACE's patched module had)
from horovod.torch import Average, Compression
from horovod.torch import DistributedOptimizer as _horovod_optimizer

from ..errors import GraceConfigError
from ..grace import Grace
from ..training.optimizer import DistributedOptimizer as _grace_optimizer


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    grace: Grace | None = None,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: type = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
) -> torch.optim.Optimizer:
    """GRACE's signature. With ``grace=None`` this is Horovod's own optimizer; with a
    :class:`~grace_dgc.Grace` it is grace_dgc's, which averages through the Grace (Horovod's
    ``compression``/``op``/``gradient_predivide_factor``/``num_groups`` do not apply to it and
    must keep their defaults)."""
    if grace is None:
        return _horovod_optimizer(
            optimizer,
            named_parameters=named_parameters,
            compression=compression,
            backward_passes_per_step=backward_passes_per_step,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            num_groups=num_groups,
        )
    if not isinstance(grace, Grace):
        raise GraceConfigError(
            f"the second argument must be a Grace (grace_from_params, Allgather(...)), got {type(grace).__name__}"
        )
    changed = [
        name
        for name, value, default in (
            ("compression", compression, Compression.none),
            ("op", op, Average),
            ("gradient_predivide_factor", gradient_predivide_factor, 1.0),
            ("num_groups", num_groups, 0),
        )
        if value != default
    ]
    if changed:
        raise GraceConfigError(
            f"{', '.join(changed)} cannot be combined with a Grace (it compresses and averages "
            f"itself); accepted: their defaults"
        )
    return _grace_optimizer(optimizer, grace, named_parameters, backward_passes_per_step=backward_passes_per_step)
