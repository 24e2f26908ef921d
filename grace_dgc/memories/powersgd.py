from ..registry import register_memory
from .residual import ResidualMemory


@register_memory("powersgd")
class PowerSGDMemory(ResidualMemory):
    """PowerSGD's error feedback (Vogels et al. 2019, Algorithm 2): the residual memory.

        M_t = e_t + g_t                  (compensate)
        e_{t+1} = M_t − P̂ Q_localᵀ       (update: M_t minus the decompressed local payload)

    The ``powersgd`` compressor's local payload in its last round is Q_local = M_tᵀ P̂, so no
    PowerSGD-specific code is needed here. The per-rank error differs from PyTorch's hook
    (which subtracts the aggregated P̂ Q_sumᵀ/W), but its sum over ranks is the same — and only
    that sum reaches the aggregate, since every exchanged quantity is linear in Σ_ranks M.
    Dense tensors (biases) decompress to themselves: their residual is exactly 0.

    GRACE's PowerSGDMemory also re-drew a random Q every step (defeating warm start) and shared
    a Q dict with the compressor; here the compressor owns Q (and its warm start) alone.
    """
