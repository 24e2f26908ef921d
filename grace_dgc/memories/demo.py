"""DeMo's decoupled momentum (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

The reference (github.com/bloc97/DeMo ``demo.py`` at 0e48145) keeps one buffer ``delta`` per
parameter on each rank, never synchronised: ``delta ← decay·delta`` (l.128-129), ``delta +=
lr·grad`` (l.132), then ``delta −= IDCT(its own sent coefficients)`` (l.140-145), with
``compression_decay = 0.999`` (l.24, ``OLMo-*-demo.yaml``) and ``0 ≤ decay < 1`` (l.51-54).
Its optimizer is ``torch.optim.SGD`` with momentum, dampening, nesterov and weight decay all
forced to 0 (l.30-38): this buffer *is* the momentum. Weight decay there is decoupled,
p ← (1 − lr·wd)·p before the step (l.124-125); it is not a gradient transform, so it is not
here (give the optimizer none; AdamW-style decay would be the optimizer's job).

Here the gradient enters unscaled (the paper's m ← β·m + g): the reference's lr·g differs only
by the lr's units, which the sign of the update removes while the lr is constant; under an lr
schedule the reference weights each past gradient by the lr of its step, this memory does not.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..errors import check_range
from ..registry import register_memory
from .residual import ResidualMemory

if TYPE_CHECKING:
    from torch import Tensor


log = logging.getLogger("grace_dgc")


@register_memory("demo")
class DemoMemory(ResidualMemory):
    """DeMo's decoupled momentum: m ← β·m + g, the compressor sends q from m, m ← m − q

    Per tensor, on each rank apart (the momenta are never averaged: "decoupled"):
      1. compensate: m_t = β·m_{t−1} + g_t, in the memory's own buffer (returned);
      2. the compressor (``demo``) sends q_t = IDCT(top-k per chunk of DCT(m_t));
      3. update: m_t ← m_t − q_t (``compressor.subtract_sent_``): what was sent leaves the
         momentum, the slow components stay and keep accumulating.
    It is the residual memory with γ = 1 and β = ``beta`` (default 0.999, the reference's
    ``compression_decay``; 0 ≤ β < 1 as there). It replaces the optimizer's momentum: use
    ``torch.optim.SGD(..., momentum=0)`` as the paper does (a warning says so otherwise).
    """

    SETTINGS = ("beta", "gamma")  # gamma: always 1 (the gradient enters unscaled)

    def __init__(self, beta: float = 0.999) -> None:
        super().__init__(beta=check_range("beta", beta, 0, 1, high_open=True), gamma=1.0)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer | None, named_parameters: dict[str, Tensor]) -> None:
        """Warn about an optimizer momentum on top of this one (not the method)."""
        if optimizer is None:
            return
        stacked = [
            f"group {index}: momentum={group['momentum']}"
            for index, group in enumerate(optimizer.param_groups)
            if group.get("momentum", 0) not in (0, 0.0)
        ]
        if stacked:
            log.warning(
                "memory demo keeps DeMo's momentum (beta=%s); %s applies momentum of its own (%s): "
                "the paper uses plain SGD (momentum=0)",
                self.beta,
                type(optimizer).__name__,
                "; ".join(stacked),
            )
