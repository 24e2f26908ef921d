from torch import Tensor

from ..errors import check_range
from ..interfaces import Payload
from ..registry import register_compressor
from .sparse import SparseCompressor, SparseContext, at_least, sparse_payload


@register_compressor("threshold")
class ThresholdCompressor(SparseCompressor):
    """Gradient dropping with one absolute threshold (Aji & Heafield 2017):

        S = { i : |g_i| ≥ τ },   payload = (g_S, S)  — a variable number of elements.

    Ranks send different sizes, so it needs allgather or broadcast.
    """

    SETTINGS = ("threshold",)

    def __init__(self, threshold: float = 0.01) -> None:
        self.threshold = check_range("threshold", threshold, 0, allow_inf=True)  # ∞: send nothing

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, SparseContext]:
        flat = tensor.reshape(-1)
        indices, _ = at_least(flat, self.threshold, self.workspace, keep_nan=False)
        return sparse_payload(flat, indices), SparseContext(tensor.shape, tensor.dtype)
