"""Streaming DiLoCo: DiLoCo synchronized fragment by fragment, each exchange overlapping the
next inner steps (Douillard et al. 2025, arXiv 2501.18512)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ...errors import GraceConfigError, StepDiscarded, check_choice, check_range
from ..driver import FUSION_BYTES
from .base import Named, Pending
from .outer import OuterSync
from .registry import register_schedule

if TYPE_CHECKING:
    from ...grace import Grace

log = logging.getLogger("grace_dgc")

PATTERNS = ("strided", "sequential")


@dataclass
class _Exchange:
    """One fragment's outer gradient on its way: the groups' Futures (or, once resolved or
    loaded from a checkpoint, the averages by name) and whether a rank's Δ was not finite."""

    due: int
    pending: Pending
    skipped_before: Future[int] | None = None
    skipped_after: Future[int] | None = None
    averages: dict[str, Tensor] | None = None
    skipped: bool = False

    def resolve(self, names: dict[torch.nn.Parameter, str]) -> dict[str, Tensor]:
        if self.averages is None:
            self.averages = {names[p]: avg for group, fut in self.pending for p, avg in zip(group, fut.result())}
            assert self.skipped_before is not None and self.skipped_after is not None
            self.skipped = self.skipped_after.result() != self.skipped_before.result()
            self.pending = []
        return self.averages


@register_schedule("streaming_diloco", aliases=("streaming",))
class StreamingDiLoCo(OuterSync):
    """Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, Algorithm 2): the
    parameters are split into P = ``fragments`` fragments, fragment p synchronizes every H =
    ``inner_steps`` steps with its own offset, and its exchange overlaps τ = ``delay`` inner
    steps.

    1. Fragments: the parameters in the optimizer's order, ``pattern="strided"`` (parameter i
       in fragment i mod P, the paper's better pattern, there over transformer blocks) or
       ``"sequential"`` (P consecutive runs of about equal count).
    2. Staggered schedule: fragment p sends after the inner steps t with
       t ≡ t_p (mod H), t ≥ t_p, t_p = ⌊(p+1)·H/P⌋, so the fragments' exchanges are spread
       evenly over a round (peak bandwidth ÷ P) and the last fragment keeps DiLoCo's rhythm.
    3. Send: Δ_p = θ_start,p − θ_p (start minus end, as DiLoCo) through the Grace on its
       communication thread (any compressor: ``fp4`` as the paper's E3M0 by
       :func:`streaming_grace`); the training thread goes on with the next inner steps.
    4. Apply, τ steps later (after step t + τ): wait for the average Δ̄_p, then
       θ_global,p = OuterOpt(θ_start,p, Δ̄_p) (Nesterov SGD, lr 0.7, μ 0.9 as DiLoCo; one outer
       SGD whose momentum buffers are per parameter, stepped on fragment p's only), the
       fragment's next start θ_start,p ← θ_global,p, and the local parameters, which went on
       for τ steps, are merged: θ_p ← α·θ_local,p + (1 − α)·θ_global,p (``torch.lerp``) with
       α = ``mixing`` (0.5 by default, the paper's choice; τ = 0 leaves nothing local to keep
       and needs α = 0, which is DiLoCo per fragment).

    ``synchronize_now()`` applies what is in flight and then synchronizes every fragment at
    once with α = 0, so every rank holds the same θ (before evaluating or saving). A fragment
    whose Δ is not finite on some rank is dropped alike on every rank (θ_p ← θ_start,p).
    ``state_dict()`` waits for the exchanges in flight and saves their averages, which a
    resumed run applies at the same step: resume is bit for bit, mid-fragment too.
    ``stats()["syncs"]`` counts fragment synchronizations.

    Deviations: fragments are over parameters, not transformer blocks (grace_dgc does not
    know a model's blocks; pass the parameters in block order for the paper's pattern), and
    the outer gradient's quantization is the Grace's compressor, its aggregation the Grace's
    communicator (the paper sums FP4 values in FP32; ``fp4`` with allgather does the same).
    """

    SETTINGS: ClassVar[tuple[str, ...]] = (*OuterSync.SETTINGS, "fragments", "pattern", "delay", "mixing")
    PLAIN: ClassVar[tuple[str, ...]] = ("in_flight",)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Named = None,
        *,
        inner_steps: int = 100,
        fragments: int = 4,
        pattern: str = "strided",
        delay: int = 1,
        mixing: float = 0.5,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fusion_bytes: int = FUSION_BYTES,
    ) -> None:
        steps = check_range("inner_steps", inner_steps, 1, kind=int)
        self.fragments = check_range("fragments", fragments, 1, steps, kind=int)
        self.pattern = check_choice("pattern", pattern, PATTERNS)
        self.delay = check_range("delay", delay, 0, steps - 1, kind=int)
        self.mixing = check_range("mixing", mixing, 0, 1)
        if self.delay == 0 and self.mixing:
            raise GraceConfigError(
                f"mixing={mixing} with delay=0: no local steps are taken while a fragment is exchanged, so there is "
                "nothing local to mix in; accepted: delay ≥ 1, or mixing=0"
            )
        super().__init__(
            optimizer,
            grace,
            named_parameters,
            inner_steps=steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            fusion_bytes=fusion_bytes,
        )
        params = list(self._names)
        if self.fragments > len(params):
            raise GraceConfigError(f"fragments={fragments} is more than the {len(params)} parameters to split")
        count = len(params)
        if self.pattern == "strided":
            split = [params[p :: self.fragments] for p in range(self.fragments)]
        else:
            split = [
                params[p * count // self.fragments : (p + 1) * count // self.fragments] for p in range(self.fragments)
            ]
        self._fragments = split
        self._fragment_groups = [self._fusion_groups(part, self.fusion_bytes) for part in split]
        self.offsets = [(p + 1) * steps // self.fragments for p in range(self.fragments)]
        self._in_flight: dict[int, _Exchange] = {}
        self._plan(grace, [group for groups in self._fragment_groups for group in groups])

    def fragment_names(self) -> list[list[str]]:
        """The parameter names of each fragment, in order."""
        return [[self._names[p] for p in part] for part in self._fragments]

    def sends_after(self, step: int, fragment: int) -> bool:
        """Does ``fragment`` send its outer gradient after inner step ``step`` (1-based)?"""
        offset = self.offsets[fragment]
        return step >= offset and (step - offset) % self.inner_steps == 0

    def steps_between_sends(self) -> int:
        """The fewest inner steps from one fragment's send to the next fragment's (a round wraps around)."""
        offsets = sorted(set(self.offsets))
        gaps = [b - a for a, b in zip(offsets, offsets[1:])] + [self.inner_steps - offsets[-1] + offsets[0]]
        return min(gaps)

    # -- under a quorum (torchft): each fragment's exchange is a step of its own -----------------
    def begins_a_step(self) -> bool:
        # a step that sends a fragment (a group that rejoins heals there, at its peers' step count), and
        # a run's first (a restarted group heals at once)
        return self.steps == 0 or any(self.sends_after(self.steps + 1, f) for f in range(self.fragments))

    def load_state_dict(self, state_dict: dict[str, Any], *, peer: bool = False) -> None:
        """As :class:`OuterSync`'s; from a healthy peer (a group that rejoins) every fragment starts
        from its global θ_start,p: the peer's parameters carry its local steps since each fragment's
        last synchronization, which this group would send again in its next Δ_p."""
        super().load_state_dict(state_dict, peer=peer)
        if peer:
            with torch.no_grad():
                for p, name in self._names.items():
                    p.copy_(self.start[name])

    # -- the schedule -----------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step; then the fragments due are applied and those whose turn it is sent."""
        result = self._inner_step(closure)
        for fragment in [f for f, exchange in sorted(self._in_flight.items()) if exchange.due == self.steps]:
            self._apply(fragment, self.mixing)
        for fragment in range(self.fragments):
            if self.sends_after(self.steps, fragment):
                self._send(fragment)
                if self.delay == 0:
                    self._apply(fragment, self.mixing)
        return result

    def synchronize_now(self) -> bool:
        """Apply the fragments in flight, then synchronize every fragment at once (α = 0):
        the parameters are then the global θ on every rank. A no-op (False) right after one."""
        self._take_start()
        if self.since_sync == 0 and not self._in_flight:
            return False
        for fragment in sorted(self._in_flight):
            self._apply(fragment, self.mixing)
        for fragment in range(self.fragments):  # one at a time: each is a step of its own under a quorum
            self._send(fragment)
            self._apply(fragment, 0.0)
        self.since_sync = 0
        return True

    def _send(self, fragment: int) -> None:
        self.coordinator.begin()  # torchft: begun at zero_grad already, but where step() came without it
        grace = self.grace
        before = grace.run_in_order(lambda: grace.skipped)
        pending = self._send_groups(grace, self._fill(self._fragment_groups[fragment], self._outer_gradient))
        after = grace.run_in_order(lambda: grace.skipped)
        self._in_flight[fragment] = _Exchange(self.steps + self.delay, pending, before, after)

    def _apply(self, fragment: int, mixing: float) -> None:
        exchange = self._in_flight.pop(fragment)
        waiting = time.perf_counter()  # the training thread blocks here if the exchange is not done
        try:
            averages = exchange.resolve(self._names)
        except StepDiscarded:  # torchft: a group was lost during the exchange: it does not commit here
            averages, exchange.skipped = {}, True
        self.grace.add_wait(time.perf_counter() - waiting)
        if not self.coordinator.commit():  # torchft: this group's vote; the fragment's round is dropped
            exchange.skipped = True
        params = self._fragments[fragment]
        if exchange.skipped:
            self._back_to_start(params)
            self._stat_skipped += 1
            log.warning(
                "%s: fragment %d's outer gradient was not finite on some rank, or its exchange met a lost replica "
                "group; dropped (on every rank, but where torchft's vote is this group's alone)",
                self.name,
                fragment,
            )
            return
        local = {p: p.detach().clone() for p in params} if mixing else {}
        self._back_to_start(params)  # θ_p ← θ_start,p, then the outer step on Δ̄_p (only this fragment's)
        members = set(params)
        self._outer_step({p: averages[name] if p in members else None for p, name in self._names.items()})
        self._start_here(params)  # θ_start,p ← θ_global,p
        with torch.no_grad():
            for p in params if mixing else ():
                p.lerp_(local[p], mixing)  # θ_p ← θ_global,p + α·(θ_local,p − θ_global,p)

    # -- checkpoints: OuterSync's state and the exchanges in flight (PLAIN) ----------------
    @property
    def in_flight(self) -> dict[str, dict[str, Any]]:
        """The exchanges in flight (waited for): per fragment, its averages, due step and
        whether it was dropped, applied by a resumed run at the same step."""
        return {
            str(fragment): {
                "due": exchange.due,
                "skipped": exchange.skipped,
                "averages": {name: t.clone() for name, t in exchange.resolve(self._names).items()},
            }
            for fragment, exchange in self._in_flight.items()
        }

    @in_flight.setter
    def in_flight(self, saved: dict[str, dict[str, Any]]) -> None:
        self._in_flight = {
            int(fragment): _Exchange(int(s["due"]), [], averages=dict(s["averages"]), skipped=bool(s["skipped"]))
            for fragment, s in saved.items()
        }

    def _before_saving(self) -> None:
        super()._before_saving()
        for exchange in self._in_flight.values():  # before the Grace's state: their exchanges update it
            exchange.resolve(self._names)

    def _more_stats(self, out: dict[str, Any]) -> None:
        super()._more_stats(out)
        out["fragments"] = self.fragments


def streaming_grace(compressor: str = "fp4", **build_params: Any) -> Grace:
    """Streaming DiLoCo's Grace as the paper runs it: the outer gradients in 4 bits (``fp4``,
    E3M0), averaged in fp32 after an allgather. Other keywords go to :func:`grace_dgc.build`."""
    from ...registry import build

    build_params.setdefault("communicator", "allgather")
    return build(compressor, "none", **build_params)
