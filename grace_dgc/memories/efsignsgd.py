from typing import Any

from torch import Tensor

from ..errors import check_range
from ..interfaces import Compressor, Memory, Payload
from ..registry import register_memory


@register_memory("efsignsgd")
class EFSignSGDMemory(Memory):
    """Error feedback of EF-SignSGD with the step size inside: p = lr·g + e, e ← p − C(p)

    Karimireddy et al. 2019, "Error Feedback Fixes SignSGD...", Algorithm 1, γ = ``lr``:

        p_t = γ·g_t + e_t,   Δ_t = C(p_t),   x_{t+1} = x_t − Δ_t,   e_{t+1} = p_t − Δ_t

    e is kept, as in the paper, in parameter units (already multiplied by γ). The wrapped
    optimizer multiplies what Grace returns by its own lr, so the compressor is handed
    p_t/γ and learns nothing about γ:

        compensate:  p_t/γ = g_t + e_t/γ
        update:      e_{t+1} = γ·(p_t/γ − D(C(p_t/γ)))        D = compressor.decompress

    For the scaled sign C(p/γ) = C(p)/γ, so the optimizer's step γ·C(p_t/γ) is exactly the
    paper's Δ_t. No mass is lost: Σ_t γ_t·D_t + e_T = Σ_t γ_t·g_t.

    Why lr lives here (and only here): with a constant lr it changes nothing but the
    units of e (this memory then behaves as ``residual``); it matters when lr changes,
    since the paper's e is a parameter-space error. Keep ``lr`` equal to the optimizer's
    (assign ``grace.memory.lr`` after each LR-scheduler step). GRACE passes ``lr`` to its
    memory (p = lr·g + e) and to its compressor (aggregate / lr); the same ``lr=`` builds
    this pair, and the result equals GRACE's divided by the world size (GRACE sums where
    this averages, and GRACE skips the lr on the first step).
    """

    error_feedback = True

    SETTINGS = ("lr",)
    STATE = ("lr", "residuals")
    REPLICATED = ("lr",)
    RESUME_MAY_DIFFER = {"lr": "the checkpoint carries the lr the schedule had reached"}

    def __init__(self, lr: float = 1.0) -> None:
        self.lr = check_range("lr", lr, 0, low_open=True)
        self.residuals: dict[str, Tensor] = {}  # name -> e_t, in parameter units

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        residual = self.residuals.get(name)
        return tensor if residual is None else tensor + residual / self.lr

    def update(self, tensor: Tensor, name: str, compressor: Compressor, payload: Payload, ctx: Any) -> None:
        self.residuals[name] = self.lr * (tensor - compressor.decompress(payload, ctx))
