import functools
import math

import torch
from torch import Tensor

from .. import wire
from ..errors import GraceConfigError
from ..interfaces import Payload
from ..registry import register_compressor
from ..workspace import for_chunks
from .packed import PackedCompressor, Shaped, narrow_or_wide


@register_compressor("efsignsgd")
class EFSignSGDCompressor(PackedCompressor):
    """Scaled sign of EF-SignSGD, (‖p‖₁/d)·sign(p): 1 bit per element + one fp32

    Karimireddy, Rebjock, Stich & Jaggi 2019, "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", Algorithm 1:

        C(p) = (‖p‖₁ / d) · sign(p)            d = number of elements of p
        p_t = γ·g_t + e_t,   Δ_t = C(p_t),   x_{t+1} = x_t − Δ_t,   e_{t+1} = p_t − Δ_t

    This class is C; the error feedback lines are the memory ``efsignsgd`` (or the
    generic ``residual``). C keeps the L1 norm (‖C(p)‖₁ = ‖p‖₁) and is positively
    homogeneous (C(a·p) = a·C(p) for a > 0), which lets the memory carry γ.

    Wire: ⌈d/8⌉ bytes of packed sign bits (bit 1 ⇔ p_i ≥ 0) + the scale ‖p‖₁/d as one
    fp32 (4 bytes). Zero rule: an exact zero is sent as +1, so it comes back as +scale
    (an all-zero tensor has scale 0 and comes back as zeros; an empty one too).
    Aggregation: the average over ranks of the decompressed C(p_m) (``average = True``;
    GRACE sums instead). Sign bits cannot be summed: allgather or broadcast only.

    ``scale="rms"``: the scale is ‖p‖₂/√d instead (the root mean square), as in 1-bit Adam's
    compressed allreduce (Tang et al. 2021; DeepSpeed's ``compressed_allreduce``): the
    ``onebit_adam`` and ``zero_one_adam`` schedules' default compressor. It keeps the L2 norm
    (‖C(p)‖₂ = ‖p‖₂) and is positively homogeneous too.

    Plain reference: ``tests/core/test_sign.py::ref_packed`` and ``ref_scaled_sign`` (numpy): the
    packed bits equal bit for bit, the scaled signs to fp32 rounding, in
    ``test_efsignsgd_wire_and_values`` (hypothesis); the error feedback in
    ``test_efsignsgd_memory_error_feedback``.
    """

    biased = True  # E[D(C(x))] ≠ x: meant for error feedback

    chunkable = True
    sends_all = True  # a sign (or a mean) for every element, even one that decodes to 0
    SETTINGS = ("scale",)
    SCALES = ("mean", "rms")

    def __init__(self, scale: str = "mean") -> None:
        if scale not in self.SCALES:
            raise GraceConfigError(
                f"efsignsgd: scale={scale!r}; accepted: 'mean' (‖p‖₁/d, EF-SignSGD) or 'rms' (‖p‖₂/√d, 1-bit Adam)"
            )
        self.scale = scale

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        numel, flat = tensor.numel(), tensor.reshape(-1)
        # fp32 accumulation: the scale is one fp32 on the wire whatever the gradient dtype; where
        # fp32 overflows on finite values, in fp64
        if self.scale == "rms":  # ‖p‖₂/√d as DeepSpeed computes it, the squares in fp32 (not fp16's)
            norm = functools.partial(torch.linalg.vector_norm, tensor)
            scale = narrow_or_wide(lambda dtype: norm(dtype=dtype) / math.sqrt(max(numel, 1)), tensor.device)
        else:
            scale = narrow_or_wide(lambda dtype: self._l1(flat, dtype) / max(numel, 1), tensor.device)
        return [wire.pack_signs(tensor, self.workspace), scale.reshape(1)], (tensor.shape, tensor.dtype)

    def _l1(self, flat: Tensor, dtype: torch.dtype) -> Tensor:
        """‖flat‖₁ in ``dtype``: each chunk's sum on a chunk worker (for_chunks: no fork-join of
        torch's threads over the whole tensor, which a competing process stalls), then theirs."""

        def chunk(start: int, stop: int) -> Tensor:
            scratch = self.workspace.get("abs", stop - start, flat.dtype, flat.device)
            return torch.abs(flat[start:stop], out=scratch).sum(dtype=dtype)

        partial = for_chunks(chunk, flat.numel(), flat.device)
        return torch.stack(partial).sum() if partial else flat.new_zeros((), dtype=dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        scale: Tensor | float  # the payload's fp32 tensor, and its value on a CPU
        packed, scale = payload
        if scale.device.type == "cpu":  # a read costs nothing there; elsewhere it is read on the device
            scale = float(scale)  # ±1 · scale is exactly ±scale
        return wire.unpack_select(packed, out, scale, -scale, self.workspace)
