"""The outer-loop schedules: DiLoCo, local SGD and SparseLoCo, one algorithm
(:class:`OuterSync`) with each method's defaults."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ...errors import GraceConfigError, StepDiscarded, check_bool, check_range
from ..driver import FUSION_BYTES
from .base import Named, Schedule
from .registry import SCHEDULES, Preset, register_schedule

if TYPE_CHECKING:
    from ...grace import Grace

log = logging.getLogger("grace_dgc")


class OuterSync(Schedule):
    """An inner optimizer stepped locally; every ``inner_steps`` steps an outer step on the
    average over ranks of the outer gradient (DiLoCo, Douillard et al. 2023, arXiv 2311.08105,
    Algorithm 1; local SGD, Lin et al. 2018, arXiv 1808.07217, and torch's
    ``PostLocalSGDOptimizer`` as the case outer_lr=1, no momentum).

    Algorithm 1 of the DiLoCo paper, as done here (θ: the parameters; H = ``inner_steps``):

    1. Initialisation: every worker starts from the same θ⁽⁰⁾ ("Require: initial model θ⁽⁰⁾";
       the paper's main runs start from a checkpoint pretrained with synchronous data
       parallelism). Here θ_start, the copy of θ the round starts from, is taken at the first
       ``step()``: broadcast the parameters before it
       (``grace_dgc.broadcast_parameters(model.state_dict(), root_rank=0)``), or the ranks'
       rounds start from different points and never agree.
    2. Inner loop: each worker sets θ_i ← θ⁽ᵗ⁻¹⁾ and takes H steps of the inner optimizer
       (AdamW in the paper) on its own data, with no communication. Algorithm 1 resets only
       the parameters: the inner optimizer's state (Adam's moments, its step count, an LR
       schedule) is left alone, so here each rank keeps its own across synchronizations, never
       exchanged nor reset (as torchft's ``DiLoCo`` does).
    3. Outer gradient: Δ⁽ᵗ⁾ = (1/k) Σᵢ (θ⁽ᵗ⁻¹⁾ − θᵢ⁽ᵗ⁾), *start minus end*: the sign of a gradient
       (a step of plain SGD gives Δ = lr·g). Each rank forms θ_start − θ and the Grace averages
       it (``step_group_async`` in fusion groups of up to ``fusion_bytes``): its compressor,
       memory (error feedback on Δ, kept per parameter name across rounds) and communicator
       act on Δ exactly as on a gradient.
    4. Outer step: θ⁽ᵗ⁾ = OuterOpt(θ⁽ᵗ⁻¹⁾, Δ⁽ᵗ⁾): θ ← θ_start, then a ``torch.optim.SGD`` over the
       same parameters (built once: its momentum buffer persists from round to round) steps
       with ``p.grad`` = the averaged Δ. With Nesterov (the paper's outer optimizer):
       m ← μ·m + Δ; θ ← θ_start − η·(Δ + μ·m). The paper's outer lr η = 0.7 and momentum
       μ = 0.9 are ``diloco``'s defaults; ``local_sgd`` is η = 1, μ = 0: θ ← mean of the θᵢ.
       The inner gradients in ``p.grad`` are put back afterwards.
    5. θ_start ← θ (a copy): the next round starts here, on every rank alike (the averages are
       bitwise equal on every rank, and so is everything computed from them).

    ``step()`` is the inner optimizer's step, and every H-th call also synchronizes;
    ``synchronize_now()`` ends a round early (before evaluating or saving: the parameters
    are then the global θ on every rank). ``zero_grad``, ``param_groups`` and ``state`` are
    the inner optimizer's, so LR schedulers act on it; ``outer_optimizer`` is the outer SGD
    (its LR may be scheduled too). The memory of the Grace is attached to the outer optimizer
    (``momentum`` takes over the outer SGD's momentum, as it does an SGD's under
    ``DistributedOptimizer``). Use one Grace per schedule: its memory and step counters are
    keyed by the parameter names.

    A round whose outer gradient is not finite on some rank (Grace's ``nonfinite="skip"``)
    is dropped alike on every rank: θ ← θ_start, no outer step (``stats()["skipped_syncs"]``);
    with ``nonfinite="raise"`` the error propagates.
    """

    SETTINGS: ClassVar[tuple[str, ...]] = ("inner_steps", "outer_lr", "outer_momentum", "nesterov", "fusion_bytes")
    COUNTERS: ClassVar[tuple[str, ...]] = ("steps", "since_sync", "syncs")
    STATS: ClassVar[dict[str, str]] = {"steps": "_stat_steps", "syncs": "_stat_syncs", "skipped_syncs": "_stat_skipped"}
    OBJECTS: ClassVar[tuple[str, ...]] = ("optimizer", "outer_optimizer")
    TENSORS: ClassVar[tuple[str, ...]] = ("start",)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Named = None,
        *,
        inner_steps: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fusion_bytes: int = FUSION_BYTES,
    ) -> None:
        self.inner_steps = check_range("inner_steps", inner_steps, 1, kind=int)
        self.outer_lr = check_range("outer_lr", outer_lr, 0, low_open=True)
        self.outer_momentum = check_range("outer_momentum", outer_momentum, 0, 1, high_open=True)
        self.nesterov = check_bool("nesterov", nesterov)
        if self.nesterov and self.outer_momentum == 0:
            raise GraceConfigError(
                "nesterov=True needs outer_momentum > 0 (Nesterov momentum without momentum is plain SGD); "
                "accepted: nesterov=False, or outer_momentum in (0, 1)"
            )
        self._wrap(optimizer, grace, named_parameters, fusion_bytes)
        self.outer_optimizer = torch.optim.SGD(
            list(self._names), lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov
        )
        self.start: dict[str, Tensor] = {}  # θ_start per parameter name, taken at the first step
        self.since_sync = 0  # inner steps since the last synchronization (or the start)
        self.steps = 0  # inner steps in all
        self.syncs = 0  # synchronizations in all
        self._stat_steps = self._stat_syncs = self._stat_skipped = 0  # since reset_stats() (STATS)
        self._claim(grace)  # before anything is attached: a Grace serving another way in is refused first
        grace.attach_optimizer(self.outer_optimizer, {n: p for p, n in self._names.items()})
        self._plan(grace, self._groups)  # the ranks compare every group of a round at the first synchronization

    # -- the schedule -----------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step (no communication); every ``inner_steps``-th also synchronizes.
        Returns what the inner optimizer's step returns (the closure's loss)."""
        if self.since_sync == 0:  # a round begins (torchft: once, at zero_grad if it came first)
            self.coordinator.begin()
        result = self._inner_step(closure)
        if self.since_sync >= self.inner_steps:
            self._synchronize()
        return result

    def synchronize_now(self) -> bool:
        """End the round now (every rank must call it at the same point): the average outer
        gradient of the steps since the last synchronization is applied. A no-op (False)
        right after a synchronization, where there is nothing to exchange (an outer step on
        a zero Δ would still move θ by the momentum)."""
        self._take_start()
        if self.since_sync == 0:
            return False
        self._synchronize()
        return True

    def _take_start(self) -> None:
        self._refuse_a_ddp_wrap()  # once
        if not self.start:  # the first step of a run not resumed from this schedule's state
            if self.optimizer.state:
                log.warning(
                    "%s: the inner optimizer has state (a resumed run?) but the schedule's does not: its outer "
                    "momentum, round start (θ_start) and step counts, and the Grace's state, start afresh. Save and "
                    "load the schedule's own state_dict() (it holds the inner optimizer's too), or "
                    "grace_dgc.gather_state(schedule) for a rank-0 checkpoint",
                    self.name,
                )
            self.start = {name: p.detach().clone() for p, name in self._names.items()}

    # -- the pieces of a round (Streaming DiLoCo's fragments are made of them too) ------------
    def _inner_step(self, closure: Callable[[], Any] | None) -> Any:
        self._take_start()
        result = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.steps += 1
        self.since_sync += 1
        self._stat_steps += 1
        return result

    def _outer_gradient(self, p: torch.nn.Parameter, out: Tensor) -> None:
        torch.sub(self.start[self._names[p]], p.detach(), out=out)  # Δ = θ_start − θ

    def _back_to_start(self, params: Iterable[torch.nn.Parameter]) -> None:
        with torch.no_grad():
            for p in params:  # θ ← θ_start
                p.copy_(self.start[self._names[p]])

    def _outer_step(self, gradients: Mapping[torch.nn.Parameter, Tensor | None]) -> None:
        """The outer SGD's step on these gradients (None: SGD skips the parameter); the inner
        gradients in ``p.grad`` are given back after it."""
        saved = {p: p.grad for p in self._names}
        try:
            for p, gradient in gradients.items():
                p.grad = gradient
            self.outer_optimizer.step()
        finally:
            for p, grad in saved.items():
                p.grad = grad

    def _start_here(self, params: Iterable[torch.nn.Parameter]) -> None:
        """θ_start ← θ for ``params``: a synchronization is done, and counted (``syncs``)."""
        with torch.no_grad():
            for p in params:  # θ_start ← θ
                self.start[self._names[p]].copy_(p)
        self.syncs += 1
        self._stat_syncs += 1

    def _synchronize(self) -> None:
        mark = self.grace.skipped  # θ_start was taken by step() or synchronize_now() before any call here
        try:
            groups = self._fill(self._groups, self._outer_gradient)
            averages = self._wait(self.grace, self._send_groups(self.grace, groups))
        except StepDiscarded:  # a fault-tolerant job lost a group: this group's round does not commit
            averages = {}
        self._back_to_start(self._names)
        self.since_sync = 0
        committed = self.coordinator.commit()  # every group asks, whatever it met
        if self.grace.skipped != mark or not committed:  # every rank drops the round alike
            self._stat_skipped += 1
            log.warning(
                "%s: the outer gradient was %s; this round is dropped on every rank (parameters back to the "
                "start of the round, no outer step)",
                self.name,
                "not finite on some rank" if committed else "not committed (a replica group was lost)",
            )
            return
        self._outer_step(averages)
        self._start_here(self._names)

    # -- stats and checkpoints (the rest follows from the declarations: Driver) -----------
    def _more_stats(self, out: dict[str, Any]) -> None:
        """steps: inner optimizer steps; syncs: synchronizations (skipped_syncs: rounds dropped
        for a non-finite outer gradient); inner_steps: the setting H; bytes_per_sync:
        bytes_sent / syncs; bytes_per_step: bytes_sent / steps, the cost per optimizer step
        to compare with per-step methods (= bytes_per_sync / H when steps is a multiple of H)."""
        sent = out["bytes_sent"]
        out["inner_steps"] = self.inner_steps
        out["bytes_per_sync"] = sent / self._stat_syncs if self._stat_syncs else 0.0
        out["bytes_per_step"] = sent / self._stat_steps if self._stat_steps else 0.0

    def begins_a_step(self) -> bool:
        return self.since_sync == 0  # a round begins

    def replicas(self) -> dict[str, Tensor]:
        """θ_start: what every rank holds alike when a round's exchange runs (the parameters
        have moved apart by then)."""
        self._take_start()
        return dict(self.start)

    def _before_saving(self) -> None:
        """The round's start is part of the state from the first step on (taken now if not yet).

        Between synchronizations every rank's parameters and inner optimizer state are its
        own, and so is the Grace's state always: for a bit-for-bit resume save each rank's
        file. A rank-0-only checkpoint (``gather_state(schedule)`` carries every rank's Grace
        state) is best taken right after ``synchronize_now()``, where the parameters, θ_start
        and the outer optimizer agree on every rank."""
        self._take_start()


DiLoCo = Preset(
    OuterSync,
    """DiLoCo (Douillard et al. 2023): H inner steps, then outer SGD with Nesterov momentum on the
    averaged outer gradient; the paper's outer lr 0.7 and momentum 0.9 (OuterSync's defaults).""",
)
LocalSGD = Preset(
    OuterSync,
    """Local SGD / model averaging every H steps (Lin et al. 2018; torch's ``PostLocalSGDOptimizer``
    after its warm-up): the outer step with lr 1 and no momentum, θ ← θ_start − (θ_start − mean θᵢ) =
    the mean of the ranks' parameters.""",
    inner_steps=8,
    outer_lr=1.0,
    outer_momentum=0.0,
    nesterov=False,
)
SCHEDULES.add("diloco", DiLoCo)
SCHEDULES.add("local_sgd", LocalSGD, aliases=("localsgd", "post_local_sgd"))


@register_schedule("sparseloco")
class SparseLoCo(OuterSync):
    """SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706, Algorithm 1): DiLoCo whose outer
    momentum is replaced by each rank's error feedback, sent as chunk-wise top-k in 2 bits.

    With Δ_r = θ_start − θ_r after H inner steps on rank r (AdamW in the paper):

        e_r ← β·e_r + Δ_r                    (memory ``residual`` with ``beta`` = β)
        Δ̂_r = Q(TopK(e_r))                   (compressor ``chunk_topk>statq``)
        e_r ← e_r − Δ̂_r
        θ ← θ_start − α·(1/R) Σ_r Δ̂_r        (this schedule: outer SGD, lr α, no momentum)

    The Grace does the first three lines (:func:`sparseloco_grace` builds the paper's: top-k
    of 64 per chunk of 4096 = 1.56 % density, 2-bit statistical quantization over ±3σ,
    β = 0.95, allgather); this schedule the last, with α = ``outer_lr`` = 1 and H =
    ``inner_steps`` = 15 by default (the paper sweeps H from 15 to 250). A Grace without
    error feedback is refused: without it the decay that stands in for momentum is gone.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Named = None,
        *,
        inner_steps: int = 15,
        outer_lr: float = 1.0,
        fusion_bytes: int = FUSION_BYTES,
    ) -> None:
        if not getattr(grace.memory, "error_feedback", False):
            raise GraceConfigError(
                f"sparseloco needs a Grace with error feedback (its decay β is the outer momentum); this one has "
                f"memory {grace.memory.registered_name!r}: build it with sparseloco_grace(), or with memory "
                "'residual' and beta=0.95"
            )
        super().__init__(
            optimizer,
            grace,
            named_parameters,
            inner_steps=inner_steps,
            outer_lr=outer_lr,
            outer_momentum=0.0,
            nesterov=False,
            fusion_bytes=fusion_bytes,
        )


def sparseloco_grace(
    chunk: int = 4096, k: int = 64, bits: int = 2, range_sigmas: float = 6.0, beta: float = 0.95, **build_params: Any
) -> Grace:
    """SparseLoCo's Grace as the paper runs it: ``chunk_topk>statq`` (k of every ``chunk``
    entries, their values in ``bits`` bits on a grid over ±``range_sigmas``/2 σ), error
    feedback decayed by ``beta``, exchanged by allgather. Other keywords (``engine``,
    ``process_group``, ``communicator``, …) go to :func:`grace_dgc.build`."""
    from ...registry import build

    build_params.setdefault("communicator", "allgather")
    return build(
        "chunk_topk>statq",
        "residual",
        chunk=chunk,
        k=k,
        bits=bits,
        range_sigmas=range_sigmas,
        beta=beta,
        **build_params,
    )
