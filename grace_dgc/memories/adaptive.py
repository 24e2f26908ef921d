"""Error feedback under an adaptive optimizer: the composition known to fail silently (issue 40),
warned of once wherever a way in hands Grace its optimizer (:meth:`grace_dgc.grace.Grace.watch`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..interfaces import Compressor, Memory

log = logging.getLogger("grace_dgc")


def _name_of(part: Any) -> str:
    return getattr(part, "registered_name", type(part).__name__)


# Optimizers that scale each coordinate by moments of their own; a plugin optimizer is counted
# in when its defaults carry Adam's ``betas`` and ``eps`` (FusedAdam, 8-bit Adam, …).
ADAPTIVE_OPTIMIZERS = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.SparseAdam,
)
_warned_compositions: set[tuple[str, str, str]] = set()


def warn_of_error_feedback_under_adam(compressor: Compressor, memory: Memory, optimizer: torch.optim.Optimizer) -> bool:
    """Log once (per composition and optimizer class) where error feedback with a biased
    compressor drives an optimizer with per-coordinate moments: the composition known to fail
    silently (issue 40). Returns whether this composition is one of them."""
    adaptive = isinstance(optimizer, ADAPTIVE_OPTIMIZERS) or {"betas", "eps"} <= set(optimizer.defaults)
    if not (adaptive and compressor.biased and memory.error_feedback):
        return False
    key = (_name_of(compressor), _name_of(memory), type(optimizer).__name__)
    if key not in _warned_compositions:
        _warned_compositions.add(key)
        log.warning(
            "%s (biased) with error-feedback memory %s under %s: Adam's per-coordinate scaling learns the "
            "compressed gradients' magnitudes, and such compositions end far above dense (measured: about 1 nat "
            "of loss on a character GPT under AdamW, docs/methods.md 'Adam'). The Adam-aware schedules onebit_adam and "
            "zero_one_adam keep the variance away from compression. To switch, in place of this wrapper (and of any "
            "DDP wrap): grace = grace_dgc.build('onebit', 'residual', 'allgather'); optimizer = "
            "grace_dgc.schedules.create('zero_one_adam', torch.optim.Adam(model.parameters(), lr=lr), grace, "
            "model.named_parameters()) (docs/engines.md 'A schedule in a DDP script')",
            *key,
        )
    return True
