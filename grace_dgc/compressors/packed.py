"""The base of the methods that encode every element into a packed code (the quantizers and
the sign methods): their ctx is the gradient's ``(shape, dtype)``, and they decode straight
into a caller's buffer, so ``decompress`` is written once here."""

from __future__ import annotations

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
