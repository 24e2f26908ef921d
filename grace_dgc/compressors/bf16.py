import torch

from ..registry import register_compressor
from .fp16 import FP16Compressor


@register_compressor("bf16", aliases=("bfloat16",))
class BF16Compressor(FP16Compressor):
    """Cast to bfloat16 for the wire: fp32's range, 8 bits of mantissa (2 bytes/element)."""

    wire_dtype = torch.bfloat16
    may_overflow = False  # the range of fp32
