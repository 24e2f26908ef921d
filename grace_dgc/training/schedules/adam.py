"""Compression-aware Adam: 1-bit Adam and 0/1 Adam as synchronization schedules.

Error feedback under Adam fails quietly: Adam divides each coordinate by √v, and v learns
the *compressed* gradients' magnitudes (a top-k residual that arrives every hundredth step
as a spike), so the update is no longer Adam's. The methods made for Adam keep v away from
compression: a dense warm-up learns v, then v is frozen (or rarely updated) and what
travels compressed is the *momentum* (1-bit Adam) or the momentum accumulated over local
steps (0/1 Adam), with error feedback on the worker and on the server side.

Why a schedule (not a memory, not a new optimizer stack): both methods decide *what* is
exchanged and *when* (the gradient densely, then the momentum; a variance step or not; a
local step or a synchronization), and they own the update, which no memory can express
under the user's optimizer. As schedules they take the user's ``torch.optim.Adam`` /
``AdamW`` (its lr, betas, eps and weight decay, read at every step so LR schedulers act on
them) and a :class:`~grace_dgc.grace.Grace`, through whose one data path the compressed
exchanges go: the compressor, the memory and the communicator stay choices. The papers'
compressed allreduce is ``build("efsignsgd", "residual", "reduce_scatter", scale="rms")``:
the scaled sign ‖x‖₂/√d·sign(x), the worker error in ``residual`` and the server error on
each chunk's owner in ``reduce_scatter(error_feedback=True)``; top-k, QSGD, THC or a plugin
take its place by name. The dense exchanges (warm-up, variance steps) go through a second,
dense Grace on the same engine (fp32 allreduce), counted in :meth:`stats`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ...errors import GraceConfigError, GraceNonFiniteError, StepDiscarded, check_bool, check_range, on_every_rank
from ..driver import FUSION_BYTES
from .base import Fill, Named, Schedule
from .registry import register_schedule

if TYPE_CHECKING:
    from ...grace import Grace


class AdamSchedule(Schedule):
    """What 1-bit Adam and 0/1 Adam share: the Adam hyper-parameters read from the wrapped
    ``Adam``/``AdamW`` (per param group), the moments m and v per parameter name (equal on
    every rank), the exchanges in fusion groups, the stats and the checkpoint."""

    SETTINGS: ClassVar[tuple[str, ...]] = ("bias_correction", "momentum_mask", "max_grad_norm", "fusion_bytes")
    COUNTERS: ClassVar[tuple[str, ...]] = ("steps", "skipped")  # steps taken (skipped ones not counted)
    STATS: ClassVar[dict[str, str]] = {"steps": "_stat_steps", "skipped_steps": "_stat_skipped"}
    OBJECTS: ClassVar[tuple[str, ...]] = ("optimizer",)
    TENSORS: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")  # m and v, equal on every rank
    GRACES: ClassVar[tuple[str, ...]] = ("grace", "dense")  # the compressed exchanges, and the warm-up's
    needs_adam = True  # a configuration check builds it over an AdamW

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Named,
        fusion_bytes: int,
        bias_correction: bool,
        momentum_mask: bool,
        max_grad_norm: float | None,
    ) -> None:
        """After the subclass's own settings are checked: then these, then the optimizer."""
        from ...registry import build

        self.bias_correction = check_bool("bias_correction", bias_correction)
        self.momentum_mask = check_bool("momentum_mask", momentum_mask)
        clip = max_grad_norm
        self.max_grad_norm = None if clip is None else check_range("max_grad_norm", clip, 0, low_open=True)
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise GraceConfigError(
                f"{self.name} is Adam with compressed communication: it reads lr, betas, eps and weight_decay from "
                f"the optimizer it wraps, which must be torch.optim.Adam or torch.optim.AdamW "
                f"(got {type(optimizer).__name__})"
            )
        for index, group in enumerate(optimizer.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise GraceConfigError(f"{self.name}: param group {index} has {flag}=True; accepted: False")
        self._wrap(optimizer, grace, named_parameters, fusion_bytes)
        # param groups by index: optimizer.load_state_dict replaces the group dicts
        self._index_of = {p: i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        # the dense exchanges: fp32 allreduce on the same engine (never in flight with grace's)
        self.dense = build("none", "none", "allreduce", engine=grace.engine, nonfinite=grace.nonfinite)
        self.steps = 0  # optimizer steps taken (skipped ones not counted)
        self.skipped = 0
        self.exp_avg: dict[str, Tensor] = {}  # m, per parameter name
        self.exp_avg_sq: dict[str, Tensor] = {}  # v
        self._stat_steps = self._stat_skipped = 0
        hyper = [{k: group[k] for k in ("betas", "eps", "weight_decay")} for group in optimizer.param_groups]
        for part in (grace, self.dense):  # the ranks compare these at each Grace's first exchange
            self._claim(part, adam=hyper)
            self._plan(part, self._groups)
        grace.attach_optimizer(optimizer, {n: p for p, n in self._names.items()})
        self.dense.watch({n: p for p, n in self._names.items()})  # ranks start from one model

    # -- the pieces of a step -----------------------------------------------------------
    def _hyper(self, p: torch.nn.Parameter) -> tuple[float, float, float, float, float, bool]:
        """lr, β1, β2, eps, weight decay and whether it is decoupled (AdamW) for ``p``, now."""
        group = self.optimizer.param_groups[self._index_of[p]]
        beta1, beta2 = group["betas"]
        decoupled = isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
        return float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], decoupled

    def _grad(self, p: torch.nn.Parameter) -> Tensor:
        """This rank's gradient (zeros where backward made none: every rank exchanges alike)."""
        return torch.zeros_like(p) if p.grad is None else p.grad.detach()

    def _decayed(self, p: torch.nn.Parameter, grad: Tensor) -> Tensor:
        """``grad`` with Adam's coupled L2 term (torch.optim.Adam's weight_decay: g + λ·p) where
        the optimizer is Adam; AdamW's decay is decoupled and applied with the update."""
        _, _, _, _, decay, decoupled = self._hyper(p)
        return grad.add(p.detach(), alpha=decay) if decay and not decoupled else grad

    def _clip(self, tensors: list[Tensor]) -> None:
        """Scale ``tensors`` in place so that their global L2 norm is at most ``max_grad_norm``
        (torch's ``clip_grad_norm_`` on them, bit for bit). As DeepSpeed's engine does, the
        gradient the method uses is clipped: the dense average where the ranks average the
        gradient, each rank's own where it steps on its own."""
        if self.max_grad_norm is None or not tensors:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
        coefficient = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        for tensor in tensors:
            tensor.mul_(coefficient)

    def _clip_local(self) -> None:
        """Clip this rank's own gradients (``p.grad``) before it uses them."""
        self._clip([p.grad for p in self._names if p.grad is not None])

    def _moments(self, p: torch.nn.Parameter) -> tuple[Tensor, Tensor]:
        name = self._names[p]
        if name not in self.exp_avg:
            self.exp_avg[name] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
            self.exp_avg_sq[name] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
        return self.exp_avg[name], self.exp_avg_sq[name]

    def _average(self, grace: Grace, fill: Fill) -> dict | None:
        """Every rank's ``fill`` averaged through ``grace``, per parameter (None: the exchange
        was skipped alike on every rank for a NaN/Inf, or a fault-tolerant job lost a group;
        nothing was changed)."""
        try:
            filled = list(self._fill(self._groups, fill))
            # one question for the whole step: a NaN/Inf anywhere skips every group alike, before
            # any of them changes the Grace's state (a group skipped alone would leave the others'
            # errors counting a step that never happened). A Grace that keeps no state and sums
            # on the wire (the dense one) needs no question: a NaN rides the sum to every rank.
            agreed = not (grace.memory.identity and grace.communicator.propagates_nonfinite)
            if agreed and grace.nonfinite_ranks([flat for _, flat, _ in filled]):
                if grace.nonfinite == "raise":
                    raise on_every_rank(GraceNonFiniteError(f"{self.name}: a gradient is not finite (NaN or Inf)"))
                return None
            mark = grace.skipped
            averages = self._wait(grace, self._send_groups(grace, filled, finite=agreed))
        except StepDiscarded:  # a fault-tolerant job lost a group: this group's step does not commit
            return None
        return None if grace.skipped != mark else averages

    def _skip(self) -> None:
        self.skipped += 1
        self._stat_skipped += 1

    def _masked(self, average: Tensor, exp_avg_sq: Tensor) -> Tensor:
        """The momentum mask (``momentum_mask``): an element whose averaged gradient was exactly 0
        at every dense step (v = 0, e.g. a position embedding past the sequences' length) gets no
        momentum from the compressor's error. DeepSpeed asks the user for this mask
        (``exp_avg_mask``); v = 0 finds it, alike on every rank."""
        return average.masked_fill_(exp_avg_sq == 0, 0) if self.momentum_mask else average

    # -- stats (the state follows from the declarations: Driver) --------------------------
    def _more_stats(self, out: dict[str, Any]) -> None:
        """The dense exchanges' bytes and times added to the compressed Grace's, and:
        steps, skipped_steps, dense_bytes_sent (the warm-up's and variance steps' share);
        :meth:`phase` says which phase the method is in."""
        dense = self.dense.stats()
        for key in ("bytes_sent", "bytes_received", "tensors", "groups", "skipped", "wait_seconds"):
            out[key] = out.get(key, 0) + dense.get(key, 0)
        for key, value in dense.items():
            if key.endswith("_seconds") and key != "wait_seconds":
                out[key] = out.get(key, 0.0) + value
        out["dense_bytes_sent"] = dense["bytes_sent"]
        out["dense_bytes"] = 4 * sum(p.numel() for p in self._names) * self._stat_steps
        out["compression_ratio"] = out["bytes_sent"] / out["dense_bytes"] if out["dense_bytes"] else 0.0
        out["bytes_per_step"] = out["bytes_sent"] / self._stat_steps if self._stat_steps else 0.0

    def phase(self) -> str:
        raise NotImplementedError

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_a_ddp_wrap()
        t = self.steps + 1
        if self._step(t):
            self.steps = t
            self._stat_steps += 1
        return loss

    def _step(self, t: int) -> bool:
        """The method's step ``t``; False where it was skipped (counted by :meth:`_skip`)."""
        raise NotImplementedError

    def synchronize_now(self) -> bool:
        """Bring every rank onto the same parameters now (before evaluating or saving): a
        no-op (False) where they already are, i.e. except inside 0/1 Adam's local steps."""
        return False


@register_schedule("onebit_adam", aliases=("1bit_adam", "onebit-adam"))
class OneBitAdam(AdamSchedule):
    """1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed", ICML, Algorithm 1; DeepSpeed's ``OnebitAdam``).

    For step t = 1, 2, … with g_i this rank's gradient, ḡ the average over ranks, and the
    wrapped optimizer's lr, β1, β2, ε and weight decay λ:

    1. Warm-up, t ≤ T_w (``freeze_step``): Adam on the dense average (fp32 allreduce),
           m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·ḡ².
    2. Compression, t > T_w: v stays frozen at v_{T_w}; each rank forms its momentum
           m_i = β1·m + (1−β1)·g_i
       and the Grace averages it: with the default composition, the worker adds its error and
       sends C(m_i + e_i) (e_i ← m_i + e_i − C(·)), each chunk's owner averages the ranks'
       chunks, adds its server error and sends C again (the server error keeps the rest):
           m ← mean_i(m_i) through C,   m ← m ⊙ [v ≠ 0]   (the momentum mask).
    3. Update (both phases, as torch's Adam/AdamW): p ← p·(1 − lr·λ) for AdamW (Adam adds
       λ·p to g_i instead), then p ← p − lr/b1 · m / (√v / √b2 + ε), with b1 = 1 − β1^t and
       b2 = 1 − β2^min(t, T_w) when ``bias_correction`` (default, torch's Adam), else 1 (DeepSpeed's
       code). With bias correction the warm-up is torch's AdamW step on ḡ, bit for bit; without,
       each step is DeepSpeed's arithmetic op for op (m·β1 + (1−β1)·g; p − lr·(m/(√v+ε) + λ·p)).

    Deviations from DeepSpeed's code, deliberate: the scale of the sign is per owner chunk
    (``reduce_scatter`` cuts each tensor into N chunks and compresses each), where DeepSpeed pads
    each tensor to a multiple of 8·N and computes one worker scale over the padded tensor; the
    mask is found from v = 0 instead of asked of the user (an element with no gradient in the
    whole warm-up, e.g. the embedding of a token not seen by then, then stays where it is: set
    ``momentum_mask=False`` to train it, at the risk the mask exists for); DeepSpeed's first
    ``step()`` only allocates its buffers, so it takes ``freeze_step`` − 1 dense steps where this
    takes ``freeze_step``; DeepSpeed does not compress on one rank; the gradient that is clipped
    (``max_grad_norm``) is the dense average in the warm-up and each rank's own after it, as
    DeepSpeed's engine clips what it hands the optimizer. A parameter without a gradient counts
    as a zero gradient (every rank exchanges the same tensors), where torch's Adam skips it.
    ``benchmarks/compare_deepspeed_adam.py`` runs both on DeepSpeed's own reference problem.
    State (checkpointed; a skipped step changes none of it): m, v, the step count; the worker
    and server errors are the Grace's.
    """

    SETTINGS = ("freeze_step", *AdamSchedule.SETTINGS)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Named = None,
        *,
        freeze_step: int = 1000,
        bias_correction: bool = True,
        momentum_mask: bool = True,
        max_grad_norm: float | None = None,
        fusion_bytes: int = FUSION_BYTES,
    ) -> None:
        self.freeze_step = check_range("freeze_step", freeze_step, 1, kind=int)
        super().__init__(
            optimizer, grace, named_parameters, fusion_bytes, bias_correction, momentum_mask, max_grad_norm
        )

    def phase(self) -> str:
        return "warm-up" if self.steps < self.freeze_step else "compressed"

    def _step(self, t: int) -> bool:
        params = list(self._names)
        if t <= self.freeze_step:  # 1. dense Adam
            averages = self._average(self.dense, lambda p, out: out.copy_(self._grad(p)))
            if not self.coordinator.commit() or averages is None:  # torchft: a group lost; or a NaN/Inf
                self._skip()
                return False
            self._clip([averages[p] for p in params])
            with torch.no_grad():
                for p in params:
                    _, beta1, beta2, *_ = self._hyper(p)
                    m, v = self._moments(p)
                    g = self._decayed(p, averages[p])
                    self._momentum(m, g, beta1, m)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        else:  # 2. the momentum through the Grace

            def momentum(p: torch.nn.Parameter, out: Tensor) -> None:
                m, _ = self._moments(p)
                self._momentum(m, self._decayed(p, self._grad(p)), self._hyper(p)[1], out)

            self._clip_local()
            averages = self._average(self.grace, momentum)
            if not self.coordinator.commit() or averages is None:
                self._skip()
                return False
            with torch.no_grad():
                for p in params:
                    m, v = self._moments(p)
                    m.copy_(self._masked(averages[p], v))
        with torch.no_grad():  # 3.
            for p in params:
                lr, beta1, beta2, eps, decay, decoupled = self._hyper(p)
                m, v = self._moments(p)
                if not self.bias_correction:  # DeepSpeed's arithmetic, op for op
                    update = m / (v.sqrt() + eps)
                    if decay and decoupled:
                        update += decay * p
                    p.add_(-lr * update)
                    continue
                first, second = 1 - beta1**t, 1 - beta2 ** min(t, self.freeze_step)
                if decay and decoupled:  # torch's AdamW, op for op
                    p.mul_(1 - lr * decay)
                p.addcdiv_(m, (v.sqrt() / second**0.5).add_(eps), value=-lr / first)
        return True

    def _momentum(self, m: Tensor, g: Tensor, beta1: float, out: Tensor) -> None:
        """out = β1·m + (1 − β1)·g: as torch's Adam computes it (lerp) with bias correction, as
        DeepSpeed's code does without (so that either is matched bit for bit)."""
        if self.bias_correction:
            torch.lerp(m, g, 1 - beta1, out=out)
        else:
            torch.mul(m, beta1, out=out).add_(g, alpha=1 - beta1)


@register_schedule("zero_one_adam", aliases=("01adam", "zeroone_adam", "0/1_adam"))
class ZeroOneAdam(AdamSchedule):
    """0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale
    Training via 0/1 Adam", ICLR 2023, Algorithm 1; DeepSpeed's ``ZeroOneAdam``).

    Two policies replace 1-bit Adam's single freeze: the variance is updated only at steps
    in T_v (adaptive freezing), and after the last of them the ranks take local steps and
    synchronize the accumulated momentum every H steps (1-bit sync with local steps).
    With t the step, κ = ``var_update_scaler``, k the variance updates so far, λ the weight
    decay and, with ``bias_correction`` (default; False: the paper's and DeepSpeed's
    arithmetic), the step size γ = lr/(1 − β1^t) and v̂ = v/(1 − β2^k) (else γ = lr, v̂ = v):

    1. Before the freeze, t ≤ ``var_freeze_step``:
       a. t ∈ T_v (t divisible by the variance interval, which starts at 1 and doubles after
          every κ variance updates): ḡ through the dense allreduce,
              m ← β1·m + (1−β1)·ḡ,   v ← β2·v + (1−β2)·ḡ²;
       b. otherwise the *gradient* through the Grace (worker and server error, DeepSpeed's
          code): ĝ ← C-mean_i g_i, ĝ ← ĝ ⊙ [v ≠ 0], m ← β1·m + (1−β1)·ĝ.
       Update: p ← p·(1 − lr·λ) (AdamW; Adam adds λ·p to g), p ← p − γ·m/(√v̂ + ε).
    2. From t = ``var_freeze_step`` + 1 (the Grace's error state is reset once: it held
       gradient errors, it will hold momentum sums), on each rank apart:
          m ← β1·m + (1−β1)·g_i,   p ← p·(1 − lr·λ) − γ·m/(√v̂ + ε),   Σγ ← Σγ + γ,  D ← D·(1 − lr·λ)
       and when t is divisible by the local-step interval H (it starts at 1 and doubles after
       every ``local_step_scaler`` frozen steps, up to ``local_step_clipper``), with p₀ the
       parameters the round started from and a = p − D·p₀ the local steps' momentum sum:
          â ← C-mean_i (a_i ⊙ (√v̂ + ε)) ⊙ [v ≠ 0],   m ← −â / Σγ,
          p ← D·p₀ + â / (√v̂ + ε),   p₀ ← p,   Σγ ← 0,  D ← 1.

    Deviations from DeepSpeed's code, deliberate: (i) the weight decay stays out of the
    synchronized sum: DeepSpeed's ``comm_buffer`` holds Σ −lr·(m/(√v+ε) + λ·p), so the rebuilt
    momentum carries λ·p·(√v+ε) and the decay acts again through m (2-10× the nominal decay for
    H = 16 … 1); here the decay is the factor D, applied to p₀ alike on every rank. (ii)
    DeepSpeed lands a synchronization on p − a + â/(√v+ε) with a summed in a buffer of its own,
    which rounds differently on each rank: keeping p₀ instead (the same one buffer) puts every
    rank on D·p₀ + â/(√v̂+ε), bitwise alike. (iii) DeepSpeed's first ``step()`` only allocates
    its buffers yet counts as step 1, so its variance and synchronization tests fall on
    (t + 1) of this t; its freeze follows update ``var_freeze_step`` as here. (iv) the sign's
    scale is per owner chunk, as in ``onebit_adam``; DeepSpeed does not compress on one rank.
    (v) a local step whose own gradient is not finite is only the decay on that rank, and still
    counts (the ranks' schedules and Σγ, D stay alike); a synchronization that is not finite on some
    rank drops the round alike on every rank (p ← D·p₀, m ← 0). (vi) A parameter without a
    gradient counts as a zero gradient (every rank exchanges the same tensors), where torch's
    Adam skips it.
    """

    SETTINGS = (
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
        *AdamSchedule.SETTINGS,
    )
    COUNTERS = (
        *AdamSchedule.COUNTERS,
        "var_interval",
        "var_counter",
        "var_updates",
        "local_step_interval",
        "local_step_counter",
        "lrs",
        "decays",
        "frozen",
        "since_sync",
    )

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Named = None,
        *,
        var_freeze_step: int = 100_000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32768,
        local_step_clipper: int = 16,
        bias_correction: bool = True,
        momentum_mask: bool = True,
        max_grad_norm: float | None = None,
        fusion_bytes: int = FUSION_BYTES,
    ) -> None:
        self.var_freeze_step = check_range("var_freeze_step", var_freeze_step, 1, kind=int)
        self.var_update_scaler = check_range("var_update_scaler", var_update_scaler, 1, kind=int)
        self.local_step_scaler = check_range("local_step_scaler", local_step_scaler, 1, kind=int)
        self.local_step_clipper = check_range("local_step_clipper", local_step_clipper, 1, kind=int)
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.lrs = [0.0] * len(optimizer.param_groups)  # Σγ over the round's local steps, per param group
        self.decays = [1.0] * len(optimizer.param_groups)  # D, per param group
        self.frozen = False
        self.since_sync = 0  # local steps since the last synchronization
        self.round_starts: dict[str, Tensor] = {}  # p₀: the parameters the round started from, per name
        super().__init__(
            optimizer, grace, named_parameters, fusion_bytes, bias_correction, momentum_mask, max_grad_norm
        )

    TENSORS = (*AdamSchedule.TENSORS, "round_starts")  # p₀ of the round, per name

    def phase(self) -> str:
        return "local steps" if self.frozen else "variance updates"

    def begins_a_step(self) -> bool:
        # a step that exchanges (each variance step) or starts a round of local steps, not a local step
        # inside a round: so a group that rejoins heals at a round's start, from parameters every group
        # shares (a peer's mid-round parameters carry its local steps, which it would send again)
        return self.steps + 1 <= self.var_freeze_step or self.since_sync == 0

    def _step_size(self, group: dict[str, Any], t: int) -> float:
        """γ: the group's lr over 1 − β1^t (with bias correction)."""
        return float(group["lr"]) / (1 - group["betas"][0] ** t if self.bias_correction else 1.0)

    def _group_decay(self, group: dict[str, Any]) -> float:
        """The factor AdamW's decoupled weight decay applies to the group this step (1 for Adam)."""
        decoupled = isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
        return 1 - float(group["lr"]) * group["weight_decay"] if group["weight_decay"] and decoupled else 1.0

    def _rates(self, p: torch.nn.Parameter, t: int) -> tuple[float, Tensor]:
        """γ (the step size) and √v̂ + ε for ``p`` at step ``t``."""
        group = self.optimizer.param_groups[self._index_of[p]]
        _, v = self._moments(p)
        second = 1 - group["betas"][1] ** max(self.var_updates, 1) if self.bias_correction else 1.0
        return self._step_size(group, t), (v.sqrt() / second**0.5).add_(group["eps"])

    def _decay(self, p: torch.nn.Parameter) -> float:
        return self._group_decay(self.optimizer.param_groups[self._index_of[p]])

    def _step(self, t: int) -> bool:
        if not self.frozen and t > self.var_freeze_step:
            self.frozen = True
            for part in (self.grace.compressor, self.grace.memory, self.grace.communicator):
                part.reset()  # gradient errors do not carry over to the momentum sums
        return self._frozen_step(t) if self.frozen else self._variance_step(t)

    def _variance_step(self, t: int) -> bool:
        params = list(self._names)
        dense = t % self.var_interval == 0
        if not dense:
            self._clip_local()
        averages = self._average(self.dense if dense else self.grace, lambda p, out: out.copy_(self._grad(p)))
        if not self.coordinator.commit() or averages is None:  # torchft: a group lost; or a NaN/Inf
            self._skip()
            return False
        if dense:
            self._clip([averages[p] for p in params])
            self.var_updates += 1
        with torch.no_grad():
            for p in params:
                _, beta1, beta2, *_ = self._hyper(p)
                m, v = self._moments(p)
                if dense:  # 1a.
                    g = self._decayed(p, averages[p])
                    m.lerp_(g, 1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                else:  # 1b.
                    m.lerp_(self._decayed(p, self._masked(averages[p], v)), 1 - beta1)
                step_size, denom = self._rates(p, t)
                p.mul_(self._decay(p))
                p.addcdiv_(m, denom, value=-step_size)
        if dense:  # the variance policy: the interval doubles after κ updates
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter, self.var_interval = 0, self.var_interval * 2
        return True

    def _frozen_step(self, t: int) -> bool:
        params = list(self._names)
        self._clip_local()
        grads = {p: self._decayed(p, self._grad(p)) for p in params}
        finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
        with torch.no_grad():
            for p in params:  # 2. the local step
                self._round_start(p)
                p.mul_(self._decay(p))
                if finite:
                    m, _ = self._moments(p)
                    m.lerp_(grads[p], 1 - self._hyper(p)[1])
                    step_size, denom = self._rates(p, t)
                    p.addcdiv_(m, denom, value=-step_size)
        # the round's Σγ and D are the schedule's, alike on every rank: a rank whose own gradient
        # was not finite takes only the decay (its momentum sum lacks this step), and counts it
        for index, group in enumerate(self.optimizer.param_groups):
            self.lrs[index] += self._step_size(group, t)
            self.decays[index] *= self._group_decay(group)
        if not finite:
            self._skip()
        self.since_sync += 1
        if t % self.local_step_interval == 0:
            self._synchronize(params, t)
        self.local_step_counter += 1  # the local-step policy: H doubles, up to the clipper
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)
        return True

    def synchronize_now(self) -> bool:
        """End the round of local steps now (every rank at the same point): the momentum
        sums so far are exchanged as at a scheduled synchronization; False where there is
        nothing to exchange (before the freeze, or right after a synchronization)."""
        if not (self.frozen and self.since_sync):
            return False
        self._synchronize(list(self._names), self.steps)
        return True

    def _round_start(self, p: torch.nn.Parameter) -> Tensor:
        name = self._names[p]
        if name not in self.round_starts:  # the first local step: the ranks' common parameters
            self.round_starts[name] = p.detach().clone()
        return self.round_starts[name]

    def _synchronize(self, params: list[torch.nn.Parameter], t: int) -> None:
        denominators = {p: self._rates(p, t)[1] for p in params}  # √v̂ + ε, once per synchronization

        def scaled(p: torch.nn.Parameter, out: Tensor) -> None:  # a ⊙ (√v̂ + ε), a = p − D·p₀
            decay = self.decays[self._index_of[p]]
            torch.sub(p, self._round_start(p), alpha=decay, out=out).mul_(denominators[p])

        averages = self._average(self.grace, scaled)
        if not self.coordinator.commit():  # torchft: this group met a lost one: its round is dropped
            averages = None
        with torch.no_grad():
            for p in params:
                m, v = self._moments(p)
                start, index = self._round_start(p), self._index_of[p]
                if averages is None:  # the round is dropped alike on every rank
                    torch.mul(start, self.decays[index], out=p)
                    start.copy_(p)
                    m.zero_()
                else:
                    average = self._masked(averages[p], v)
                    if self.lrs[index]:  # Σγ = 0 (lr 0 all round): nothing moved, m stays
                        torch.div(average, -self.lrs[index], out=m)
                    torch.add(start.mul_(self.decays[index]), average / denominators[p], out=p)
                    start.copy_(p)
        self.lrs = [0.0] * len(self.lrs)
        self.decays = [1.0] * len(self.decays)
        self.since_sync = 0
        if averages is None:
            self._skip()
