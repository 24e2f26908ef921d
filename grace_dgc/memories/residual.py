from ..errors import check_range
from ..interfaces import Memory
from ..registry import register_memory


@register_memory("residual", aliases=("ef", "error_feedback"))
class ResidualMemory(Memory):
    """Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019):

        p_t = β·e_t + γ·g_t          (compensate)
        e_{t+1} = p_t − D(C(p_t))    (update: what was not sent is kept)

    With β = γ = 1 no gradient mass is lost: Σ sent + e_T = Σ g.
    """

    def __init__(self, beta=1.0, gamma=1.0):
        self.beta = check_range("beta", beta, 0)
        self.gamma = check_range("gamma", gamma, 0)
        self.residuals = {}

    def compensate(self, tensor, name):
        residual = self.residuals.get(name)
        if residual is None:
            return tensor if self.gamma == 1 else self.gamma * tensor
        return self.beta * residual + self.gamma * tensor

    def update(self, tensor, name, compressor, payload, ctx):
        self.residuals[name] = tensor - compressor.decompress(payload, ctx)

    def state_dict(self):
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state):
        self.residuals = dict(state["residuals"])
