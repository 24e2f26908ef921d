"""The chunking wrapper ``reduce_scatter`` and ``auto`` run a quantizer through: each rank
compresses its tensor as N consecutive chunks, so chunk j can go to its owner, rank j."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..engines.base import Engine
from ..interfaces import Compressor, Payload
from ..workspace import Workspace


@dataclass
class ChunkedContext:
    """What :class:`Chunked` needs to undo its compression: the tensor's shape and dtype,
    the chunk bounds, and each chunk's ctx and payload length."""

    shape: torch.Size
    dtype: torch.dtype
    bounds: list[int]
    parts: list[Any]
    widths: list[int]


class Chunked(Compressor):
    """``inner`` applied to ``parts`` consecutive chunks of the flattened tensor (chunk j of
    ``name`` is compressed as ``name#j``); its payload is the chunks' payloads in order. The
    memory contract (``decompress``, ``subtract_sent_``, ``sent_mask``) acts chunk by
    chunk, so any memory keeps a rank's own error exactly."""

    def __init__(self, inner: Compressor, parts: int) -> None:
        self.inner, self.parts = inner, parts
        self.summable, self.average = inner.summable, inner.average
        self.may_overflow = inner.may_overflow

    @property
    def workspace(self) -> Workspace:
        return self.inner.workspace

    def bounds(self, numel: int) -> list[int]:
        return self.bounds_of(numel, self.parts)

    @staticmethod
    def bounds_of(numel: int, parts: int) -> list[int]:
        """Where each of ``parts`` chunks of ``numel`` elements starts (and the end)."""
        return [numel * j // parts for j in range(parts + 1)]

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        flat, bounds = tensor.reshape(-1), self.bounds(tensor.numel())
        payload: Payload = []
        ctxs, widths = [], []
        for j in range(self.parts):
            part, ctx = self.inner.compress(flat[bounds[j] : bounds[j + 1]], f"{name}#{j}")
            payload += part
            ctxs.append(ctx)
            widths.append(len(part))
        return payload, ChunkedContext(tensor.shape, tensor.dtype, bounds, ctxs, widths)

    def split(self, payload: Payload, ctx: ChunkedContext) -> list[Payload]:
        """The payload of each chunk."""
        out, first = [], 0
        for width in ctx.widths:
            out.append(payload[first : first + width])
            first += width
        return out

    def _chunks(self, tensor: Tensor, payload: Payload, ctx: ChunkedContext) -> Iterator[tuple[Tensor, Payload, Any]]:
        flat = tensor.view(-1)
        for j, part in enumerate(self.split(payload, ctx)):
            yield flat[ctx.bounds[j] : ctx.bounds[j + 1]], part, ctx.parts[j]

    def decompress(self, payload: Payload, ctx: ChunkedContext) -> Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=payload[0].device if payload else None)
        return self.decompress_into(payload, ctx, out)

    def decompress_into(self, payload: Payload, ctx: ChunkedContext, out: Tensor) -> Tensor:
        for chunk, part, part_ctx in self._chunks(out, payload, ctx):
            self.inner.decompress_into(part, part_ctx, chunk)
        return out

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: ChunkedContext) -> Tensor:
        for chunk, part, part_ctx in self._chunks(tensor, payload, ctx):
            self.inner.subtract_sent_(chunk, part, part_ctx)
        return tensor

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: ChunkedContext) -> Tensor:
        for chunk, part, part_ctx in self._chunks(tensor, payload, ctx):
            self.inner.mask_sent_(chunk, part, part_ctx)
        return tensor

    def sent_mask(self, payload: Payload, ctx: ChunkedContext) -> Tensor:
        masks = [self.inner.sent_mask(part, c).reshape(-1) for part, c in zip(self.split(payload, ctx), ctx.parts)]
        return torch.cat(masks).view(ctx.shape)

    def bind(self, engine: Engine) -> None:
        self.inner.bind(engine)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
