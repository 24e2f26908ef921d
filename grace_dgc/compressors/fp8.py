import torch
from torch import Tensor

from .. import kernels
from ..errors import GraceConfigError, check_range
from ..interfaces import Payload
from ..registry import register_compressor
from .packed import PackedCompressor, Shaped

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# every code's fp32 value, for decoding on a CPU: torch's fp8 -> fp32 cast is scalar code there
# (so is its uint8 -> int32 cast, which a torch lookup would need); numpy indexes the table with
# the uint8 codes directly, about a third of the cast's time. The same bits, NaN codes too.
DECODED = {name: torch.arange(256, dtype=torch.uint8).view(dtype).float() for name, dtype in FORMATS.items()}


@register_compressor("fp8", aliases=("float8",))
class FP8Compressor(PackedCompressor):
    """FP8 with a scale per block of ``block`` elements (ZeRO++'s qgZ and torchao's float8
    all-gather use blocks and per-tensor scales; MX formats blocks of 32):

        s_b = max_{i∈b} |x_i| / F    (F: the format's largest finite value, 448 for e4m3,
                                      57344 for e5m2; s_b = 1 for an all-zero block)
        q_i = fp8(x_i / s_b)          (torch's cast: round to nearest even, |q_i| ≤ F)
        D(q)_i = s_b · fp32(q_i)

    Why a block scale and no summing in fp8: the scale maps each block's largest magnitude
    onto the format's largest finite value, so nothing overflows to inf and the small
    values of a block keep the format's relative precision (e4m3: 3 mantissa bits, about
    6 % per element; e5m2: 2 bits and a wider range). Payloads under different scales
    cannot be summed as they travel — and neither gloo nor NCCL before 2.24 sums fp8 — so
    the sum is taken in fp32 after the exchange: with ``reduce_scatter`` (the bytes of a
    ring allreduce: each owner sums its chunk in fp32 and sends it back requantized, its
    error kept), allgather, hierarchical, DDP's hook and FSDP2's reduce-scatter; the plain
    ``allreduce`` communicator refuses it.

    Wire: one byte per element (the fp8 codes, viewed as uint8 to travel), then one fp32
    scale per block: n + 4·⌈n/block⌉ bytes.

    On a GPU both directions can be one Triton kernel each (:func:`grace_dgc.kernels.fp8_encode`,
    the rounding done on the bits), tested bit for bit against the torch ops below under
    Triton's interpreter; ``auto`` leaves them off until a GPU run proves them
    (:data:`grace_dgc.kernels.UNPROVEN`), ``GRACE_DGC_KERNELS=triton`` runs them.

    Plain reference: ``tests/test_sparseloco.py::reference_fp8`` (each block divided by its
    scale in float64, cast through torch's float8 dtype, multiplied back).
    """

    biased = True  # round to nearest
    chunkable = True

    SETTINGS = ("format", "block")

    def __init__(self, format: str = "e4m3", block: int = 256) -> None:
        if format not in FORMATS:
            raise GraceConfigError(f"format={format!r}; accepted: {', '.join(FORMATS)}")
        self.format = format
        self.block = check_range("block", block, 1, kind=int)
        self.dtype = FORMATS[format]
        self.largest = float(torch.finfo(self.dtype).max)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Shaped]:
        flat = tensor.reshape(-1).float()
        n, block = flat.numel(), self.block
        if n and self._fused(flat):  # a GPU: one read of the gradient, bit for bit these ops
            try:
                codes, scales = kernels.fp8_encode(flat, block, self.format)
                return [codes, scales], (tensor.shape, tensor.dtype)
            except kernels.Unavailable:  # warned; the torch ops below
                pass
        pad = (-n) % block
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block) if pad else flat.view(-1, block)
        scales = blocks.abs().amax(dim=1).div_(self.largest)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (blocks / scales[:, None]).to(self.dtype).view(-1)[:n]
        return [codes.view(torch.uint8), scales], (tensor.shape, tensor.dtype)

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        codes, scales = payload
        n, block = codes.numel(), self.block
        if n and out.dtype == torch.float32 and out.is_contiguous() and self._fused(codes):
            try:
                kernels.fp8_decode(codes, scales, block, self.format, out.view(-1))
                return out
            except kernels.Unavailable:
                pass
        if codes.device.type == "cpu":
            values = torch.from_numpy(DECODED[self.format].numpy()[codes.view(torch.uint8).numpy()])
        else:
            values = codes.view(self.dtype).float()
        pad = (-n) % block
        if not pad and out.dtype == values.dtype and out.is_contiguous():  # one pass, straight into out
            torch.mul(values.view(-1, block), scales[:, None], out=out.view(-1, block))
            return out
        if pad:
            values = torch.nn.functional.pad(values, (0, pad))
        out.view(-1).copy_(values.view(-1, block).mul_(scales[:, None]).view(-1)[:n])
        return out

    def _fused(self, tensor: Tensor) -> bool:
        return self.block <= kernels.FP8_LARGEST_BLOCK and kernels.enabled(tensor.device, kernel="fp8")
