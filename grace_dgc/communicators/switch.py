"""The compressor ``auto`` runs on each gradient: the plain method, or the method chunk by
chunk while the tensor's bucket goes by ``reduce_scatter``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import Tensor

from ..engines.base import Engine
from ..interfaces import Compressor, Payload
from ..workspace import Workspace

if TYPE_CHECKING:
    from .auto import Auto


class SwitchContext(NamedTuple):
    """ctx under ``auto``: which compressor compressed the tensor (the plain one or its
    chunked form), that compressor's ctx, and the seconds compression took (``auto``
    counts them into the bucket's cost)."""

    part: Compressor
    ctx: Any
    seconds: float


class Switch(Compressor):
    """Compresses with ``auto``'s plain compressor, or its chunked form for tensors whose
    bucket goes by ``reduce_scatter``; everything else follows the ctx's ``part``."""

    def __init__(self, auto: Auto) -> None:
        self.auto = auto
        self.summable, self.average = auto.plain.summable, auto.plain.average
        self.may_overflow = auto.plain.may_overflow

    @property
    def workspace(self) -> Workspace:
        return self.auto.plain.workspace

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, SwitchContext]:
        part = self.auto.chunked if self.auto.choice.get(name) == "reduce_scatter" else self.auto.plain
        start = time.perf_counter()
        payload, ctx = part.compress(tensor, name)
        return payload, SwitchContext(part, ctx, time.perf_counter() - start)

    def decompress(self, payload: Payload, ctx: SwitchContext) -> Tensor:
        return ctx.part.decompress(payload, ctx.ctx)

    def decompress_into(self, payload: Payload, ctx: SwitchContext, out: Tensor) -> Tensor:
        return ctx.part.decompress_into(payload, ctx.ctx, out)

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: SwitchContext) -> Tensor:
        return ctx.part.subtract_sent_(tensor, payload, ctx.ctx)

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: SwitchContext) -> Tensor:
        return ctx.part.mask_sent_(tensor, payload, ctx.ctx)

    def sent_mask(self, payload: Payload, ctx: SwitchContext) -> Tensor:
        return ctx.part.sent_mask(payload, ctx.ctx)

    def bind(self, engine: Engine) -> None:
        self.auto.plain.bind(engine)
