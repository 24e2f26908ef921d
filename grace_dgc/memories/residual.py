from typing import Any

from torch import Tensor

from ..errors import check_range
from ..interfaces import Compressor, Memory, Payload
from ..registry import register_memory


@register_memory("residual", aliases=("ef", "error_feedback"))
class ResidualMemory(Memory):
    """Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019):

        p_t = β·e_t + γ·g_t          (compensate)
        e_{t+1} = p_t − D(C(p_t))    (update: what was not sent is kept)

    With β = γ = 1 no gradient mass is lost: Σ sent + e_T = Σ g.

    e lives in one buffer per tensor, updated in place: compensate writes p_t into it and
    update subtracts what was sent (``compressor.subtract_sent_``: at the sent indices only,
    for a sparsifier), so the method holds one gradient-sized buffer per tensor, no more.
    ``state_dict`` hands out copies.
    """

    error_feedback = True

    SETTINGS = ("beta", "gamma")
    STATE = ("residuals",)

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        self.beta = check_range("beta", beta, 0)
        self.gamma = check_range("gamma", gamma, 0)
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        residual = self.residuals.get(name)
        if residual is None:
            return tensor if self.gamma == 1 else self.gamma * tensor
        if self.beta != 1:
            residual.mul_(self.beta)
        return residual.add_(tensor if self.gamma == 1 else self.gamma * tensor)

    def update(self, tensor: Tensor, name: str, compressor: Compressor, payload: Payload, ctx: Any) -> None:
        if tensor is not self.residuals.get(name):  # the first step: p_t is the input (or new)
            tensor = tensor.clone()
        self.residuals[name] = compressor.subtract_sent_(tensor, payload, ctx)
