"""The base of the methods that encode every element into a packed code (the quantizers and
the sign methods): their ctx is the gradient's ``(shape, dtype)``, and they decode straight
into a caller's buffer, so ``decompress`` is written once here."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..interfaces import Compressor, Payload

Shaped = tuple[torch.Size, torch.dtype]  # the ctx: what the decoded tensor looks like


class PackedCompressor(Compressor):
    """A compressor whose ctx is :data:`Shaped` and which implements ``decompress_into``;
    ``decompress`` allocates the output on the payload's device and decodes into it."""

    def decompress(self, payload: Payload, ctx: Shaped) -> Tensor:
        shape, dtype = ctx
        return self.decompress_into(payload, ctx, torch.empty(shape, dtype=dtype, device=payload[0].device))

    def decompress_into(self, payload: Payload, ctx: Shaped, out: Tensor) -> Tensor:
        raise NotImplementedError


def narrow_or_wide(
    scale: Callable[[torch.dtype], Tensor], device: torch.device, host_reads: bool | None = None
) -> Tensor:
    """``scale(fp32)`` as fp32, or ``scale(fp64)`` where the fp32 one is not finite (a sum or a
    norm that overflows fp32 on finite values). With ``host_reads`` (the default on a CPU, where a
    read costs nothing) the flag is read and the fp64 one runs only then; without (other devices)
    both run and a select picks, so no host read waits for the GPU. The same bits either way:
    onebit's means and efsignsgd's scale."""
    narrow = scale(torch.float32)
    if device.type == "cpu" if host_reads is None else host_reads:
        return narrow if bool(torch.isfinite(narrow)) else scale(torch.float64).float()
    return torch.where(torch.isfinite(narrow), narrow, scale(torch.float64).float())
