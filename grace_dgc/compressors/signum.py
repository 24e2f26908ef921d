import torch
from torch import Tensor

from ..errors import check_range
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import for_chunks
from .packed import Shaped
from .signsgd import SignSGDCompressor


@register_compressor("signum")
class SignumCompressor(SignSGDCompressor):
    """Signum: momentum, then 1 sign bit per element, majority vote

    Bernstein et al. 2018, "signSGD: Compressed Optimisation for Non-Convex Problems",
    Algorithm 1, with the majority vote of Algorithm 3:

        m_t = β·m_{t−1} + (1 − β)·g_t,    m_0 = 0,  β = ``momentum``
        worker m sends  sign(m_t)          (1 bit per element, as signsgd)
        every rank takes  ĝ = sign( Σ_m sign(m_t^(m)) )

    The momentum buffer m is per tensor name and per rank (each worker's own momentum,
    as in the paper's multi-worker Signum); it is part of ``state_dict``. β = 0 is
    signSGD. Wire format, zero rule (0 → +1), tie rule (tie → 0), ``average = False``
    and the communicators (allgather, broadcast) are those of ``signsgd``.

    Unlike GRACE (m_1 = g_1), the buffer starts at 0 as in the paper, so
    m_1 = (1 − β)·g_1; the first sign is the same, later ones may differ.
    """

    SETTINGS = ("momentum",)
    STATE = ("momentums",)

    def __init__(self, momentum: float = 0.9) -> None:
        self.momentum = check_range("momentum", momentum, 0, 1, high_open=True)
        self.momentums: dict[str, Tensor] = {}  # name -> m_t, updated in place (state_dict hands out copies)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        previous = self.momentums.get(name)
        if previous is None:
            momentum = self.momentums[name] = (1 - self.momentum) * tensor
        else:  # β·m + (1 − β)·g, the two products rounded as in the formula; in cache
            momentum, grad = previous.view(-1), tensor.reshape(-1)

            def update(start: int, stop: int) -> None:
                scaled = torch.mul(
                    grad[start:stop],
                    1 - self.momentum,
                    out=self.workspace.get("scaled", stop - start, grad.dtype, grad.device),
                )
                momentum[start:stop].mul_(self.momentum).add_(scaled)

            for_chunks(update, momentum.numel(), momentum.device)
            momentum = previous
        return super().compress(momentum, name)
