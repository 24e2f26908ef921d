from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..errors import GraceConfigError, check_bool, check_range
from ..interfaces import Compressor, Memory, Payload
from ..registry import register_memory

if TYPE_CHECKING:
    from ..engines.base import Engine

log = logging.getLogger("grace_dgc")


@register_memory("momentum", aliases=("dgc",))
class MomentumMemory(Memory):
    """DGC's momentum correction with factor masking and local clipping (Lin et al. 2018).

    For the gradient g of one tensor on one of N ranks (parameters w):

        g ← g · min(1, (gradient_clipping·N^-1/2) / (‖g‖₂ + 1e-6))   (local clipping, per tensor)
        g ← g + weight_decay · w                                     (decay before accumulation)
        u ← m·u + g,          v ← v + u                              (momentum correction)
        u ← m·(u + g),        v ← v + u + g                          (nesterov=True)
        compensate returns v; after compression, with M = compressor.sent_mask(...):
        v ← v ⊙ ¬M,  u ← u ⊙ ¬M                                      (momentum factor masking)

    A step in which every element with v ≠ 0 was sent (a dense payload) keeps u: that is
    plain momentum SGD, as the reference keeps momentum on the tensors it does not
    compress. With m = 0 this is error feedback for sparsifiers. Any compressor works;
    ``sent_mask`` (see :class:`~grace_dgc.interfaces.Compressor`) is the only thing read.

    With ``DistributedOptimizer`` over ``torch.optim.SGD``: every param group whose
    momentum or weight_decay is > 0 hands them (and nesterov) to this memory for its
    parameters and gets 0 instead, logged once — momentum must not be applied twice.

    Under any other optimizer (Adam, AdamW, RMSprop … keep moments of their own) this
    memory's momentum would be applied on top of the optimizer's, so it is refused unless
    built with ``momentum=0``: then u = g and v accumulates what was not sent (DGC's local
    gradient accumulation with factor masking), and the optimizer's moments do the rest.
    """

    error_feedback = True

    SETTINGS = ("momentum", "nesterov", "weight_decay", "gradient_clipping", "momentum_masking")
    STATE = ("momentums", "velocities")
    RANK_LOCAL = {
        "parameters": "the model's parameters, handed over by attach_optimizer (the model saves them)",
        "settings": "taken from the optimizer's param groups by attach_optimizer, again on resume",
    }

    def __init__(
        self,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        gradient_clipping: float | None = None,
        momentum_masking: bool = True,
    ) -> None:
        self.momentum = check_range("momentum", momentum, 0, 1, high_open=True)
        self.nesterov = check_bool("nesterov", nesterov)
        self.weight_decay = check_range("weight_decay", weight_decay, 0)
        self.gradient_clipping = (
            None if gradient_clipping is None else check_range("gradient_clipping", gradient_clipping, 0, low_open=True)
        )
        self.momentum_masking = check_bool("momentum_masking", momentum_masking)
        self.world_size, self.rank = 1, 0
        self.parameters: dict[str, Tensor] = {}  # name -> parameter (for weight decay), from attach_optimizer
        # name -> (momentum, nesterov, weight_decay) taken from SGD groups
        self.settings: dict[str, tuple[float, bool, float]] = {}
        self.momentums: dict[str, Tensor] = {}  # u
        self.velocities: dict[str, Tensor] = {}  # v

    def bind(self, engine: Engine) -> None:
        """Called by Grace: clipping scales its threshold by the world size; rank 0 alone says
        what it took over (every rank takes over the same: the handshake compares them)."""
        self.world_size, self.rank = engine.size, engine.rank

    def attach_optimizer(self, optimizer: torch.optim.Optimizer | None, named_parameters: Any) -> None:
        """Called by DistributedOptimizer: learn the parameters; take over SGD's momentum."""
        self.parameters = dict(named_parameters)
        if optimizer is None:  # the DDP hook without an optimizer: nothing to take over
            if self.momentum > 0:  # a momentum the optimizer also applies would be applied twice
                log.warning(
                    "the momentum memory applies momentum=%s before compression and was given no optimizer to "
                    "take over: if the optimizer applies momentum too, it is applied twice. Pass it "
                    "(ddp_comm_hook(grace, model, optimizer)), or use an optimizer without momentum",
                    self.momentum,
                )
            return
        if not isinstance(optimizer, torch.optim.SGD):
            if self.momentum > 0 or self.nesterov:
                raise GraceConfigError(
                    f"the momentum memory applies momentum={self.momentum} before compression (DGC's momentum "
                    f"correction) and {type(optimizer).__name__} applies moments of its own: momentum would be "
                    "applied twice. Accepted: torch.optim.SGD (its momentum is taken over), or momentum=0 for "
                    f"DGC's gradient accumulation alone under {type(optimizer).__name__}"
                )
            return
        names = {id(p): n for n, p in self.parameters.items()}
        moved = []
        for index, group in enumerate(optimizer.param_groups):
            momentum, decay = group.get("momentum", 0), group.get("weight_decay", 0)
            if not (momentum > 0 or decay > 0):
                continue
            if momentum > 0 and group.get("dampening", 0) != 0:
                raise GraceConfigError(
                    f"SGD param group {index} has dampening={group['dampening']}; the momentum memory "
                    f"implements u ← m·u + g only; accepted: dampening=0"
                )
            setting = (
                momentum if momentum > 0 else self.momentum,
                bool(group.get("nesterov")) if momentum > 0 else self.nesterov,
                decay if decay > 0 else self.weight_decay,
            )
            for param in group["params"]:
                if id(param) in names:
                    self.settings[names[id(param)]] = setting
            moved.append(
                f"group {index}: momentum={momentum}, nesterov={group.get('nesterov', False)}, weight_decay={decay}"
            )
            group.update(momentum=0, weight_decay=0, nesterov=False)
        if moved and self.rank == 0:
            log.warning(
                "momentum memory took over SGD's momentum/weight decay (SGD's set to 0, "
                "applied before compression instead): %s",
                "; ".join(moved),
            )

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        momentum, nesterov, decay = self.settings.get(name, (self.momentum, self.nesterov, self.weight_decay))
        grad = tensor
        if self.gradient_clipping is not None:
            max_norm = self.gradient_clipping / math.sqrt(self.world_size)
            norm = grad.norm()
            if not bool(torch.isfinite(norm)):  # ‖g‖² overflowed fp32 (or g is not finite)
                scale = grad.abs().max()
                norm = grad.div(scale).norm() * scale if bool(torch.isfinite(scale)) and scale > 0 else norm
            grad = grad * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if decay:
            if name not in self.parameters:
                raise GraceConfigError(
                    f"weight_decay needs the parameter {name!r}: wrap the optimizer with "
                    f"DistributedOptimizer(optimizer, grace, model.named_parameters()) or call "
                    f"grace.attach_optimizer(optimizer, dict(model.named_parameters()))"
                )
            grad = grad + decay * self.parameters[name].detach().reshape(grad.shape)
        if name not in self.momentums:
            self.momentums[name], self.velocities[name] = torch.zeros_like(grad), torch.zeros_like(grad)
        u, v = self.momentums[name], self.velocities[name]
        # In place: on large layers, fresh full-size buffers every step cost more than the math.
        if nesterov:
            u.add_(grad).mul_(momentum)
            v.add_(u).add_(grad)
        else:
            u.mul_(momentum).add_(grad)
            v.add_(u)
        return v  # the memory's own buffer: update() changes it only after the aggregate is written

    def update(self, tensor: Tensor, name: str, compressor: Compressor, payload: Payload, ctx: Any) -> None:
        v, u = self.velocities[name], self.momentums[name]
        compressor.mask_sent_(v, payload, ctx)  # v ← v ⊙ ¬M (sparsifiers: at their indices)
        # u is masked too unless the step was dense: every element with v ≠ 0 was sent, i.e.
        # nothing is left in v (one host sync on an accelerator)
        if self.momentum_masking and torch.count_nonzero(v):
            compressor.mask_sent_(u, payload, ctx)
