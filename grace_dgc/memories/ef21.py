from __future__ import annotations

from typing import Any

from torch import Tensor

from ..errors import check_range
from ..interfaces import Compressor, Memory, Payload
from ..registry import register_memory


@register_memory("ef21")
class EF21Memory(Memory):
    """EF21: error feedback that sends compressed *changes* of a gradient estimate

    Richtárik, Sokolov & Fatkhullin 2021, "EF21: A New, Simpler, Theoretically Better, and
    Practically Faster Error Feedback" (NeurIPS), Algorithm 1; with ``eta < 1`` the momentum
    variant EF21-SGDM of Fatkhullin, Tyurin & Richtárik 2023, "Momentum Provably Improves
    Error Feedback!" (NeurIPS), Algorithm 1. Rank i keeps its estimate g_i, every rank keeps
    the shared estimate g = (1/N) Σ_i g_i (equal on all ranks: each adds the same average),
    and at step t, with ∇_i its stochastic gradient:

        1. v_i ← (1 − η)·v_i + η·∇_i     (EF21-SGDM; η = 1 is EF21: v_i = ∇_i)
        2. c_i = C(v_i − g_i)            (compensate returns v_i − g_i; the compressor sends c_i)
        3. g_i ← g_i + c_i               (update)
        4. g ← g + (1/N)·Σ_i c_i         (decode_average: the communicator's average of the c_i)
        5. the optimizer steps with g    (x ← x − γ·g)

    Unlike classic error feedback (``residual``), nothing is kept of what was *not* sent:
    the compressor's error is corrected next step because v_i − g_i still holds it, which is
    what gives EF21 its rates for any contractive (biased) compressor: top-k, sign with
    scale, … . Start: g_i = g = 0, so the first step sends C(v_i); v_i starts at the first
    gradient (no 1/η bias). EF21-SGDM replaces the optimizer's momentum: run plain SGD
    (momentum 0) beside it, as the paper does.

    State (checkpointed, restored after a skipped step): ``estimates`` g_i (rank-local
    values), ``shared`` g (equal on every rank), ``momenta`` v_i (η < 1 only).
    Reference: ``tests/core/test_ef21.py::reference_ef21``, a loop over all ranks' gradients.
    """

    SETTINGS = ("eta",)
    STATE = ("estimates", "shared", "momenta")
    RESET_WHEN_RANKS_CHANGE = True  # g is the mean of every rank's g_i: a rank lost takes its g_i along

    def __init__(self, eta: float = 1.0) -> None:
        self.eta = check_range("eta", eta, 0, 1, low_open=True)
        self.estimates: dict[str, Tensor] = {}
        self.shared: dict[str, Tensor] = {}
        self.momenta: dict[str, Tensor] = {}

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        target = tensor
        if self.eta < 1:  # 1.
            momentum = self.momenta.get(name)
            if momentum is None:
                momentum = self.momenta[name] = tensor.clone()
            else:
                momentum.mul_(1 - self.eta).add_(tensor, alpha=self.eta)
            target = momentum
        estimate = self.estimates.get(name)
        return target if estimate is None else target - estimate  # 2. (a new tensor: never the input)

    def update(self, tensor: Tensor, name: str, compressor: Compressor, payload: Payload, ctx: Any) -> None:
        sent = compressor.decompress(payload, ctx).reshape(tensor.shape).to(tensor.dtype)
        estimate = self.estimates.get(name)
        if estimate is None:  # 3. (a copy where decompress handed back the compensated tensor: none)
            self.estimates[name] = sent if sent.data_ptr() != tensor.data_ptr() else sent.clone()
        else:
            estimate.add_(sent)

    def decode_average(self, average: Tensor, name: str) -> None:
        shared = self.shared.get(name)
        if shared is None:  # 4.
            self.shared[name] = average.clone()
        else:
            self.shared[name] = shared.add_(average)
            average.copy_(shared)


@register_memory("ef21-sgdm", aliases=("ef21_sgdm",))
class EF21SGDMMemory(EF21Memory):
    """EF21-SGDM (Fatkhullin, Tyurin & Richtárik 2023): EF21 on a momentum of the gradients

    :class:`EF21Memory` with η = 0.1 by default (the paper's experiments use η ∈ [0.01, 0.1]).
    """

    def __init__(self, eta: float = 0.1) -> None:
        super().__init__(eta)
