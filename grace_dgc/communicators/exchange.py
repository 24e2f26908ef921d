"""The base of the communicators that move whole payloads (allreduce, allgather, broadcast),
GRACE's ``exchange(payload, name)`` shape, and :func:`regroup`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..interfaces import Communicator, Compressor, Ctxs, Payload, Payloads, Sent, Tensors
from ..rounds import aggregate_rounds
from ..stats import phase

__all__ = ["ExchangeCommunicator", "regroup"]


class ExchangeCommunicator(Communicator):
    """A communicator that moves whole payloads: ``exchange(payload, name)`` returns every
    rank's payload (allgather, broadcast), or the single payload summed over ranks
    (allreduce, which overrides :meth:`combine` and :meth:`decompress_exchanged`).
    :meth:`aggregate_into` exchanges a fusion group's payloads together, then decompresses
    (multi-round methods go through :func:`grace_dgc.rounds.aggregate_rounds`)."""

    carries_rounds = True

    def exchange(self, payload: Payload, name: str) -> list[Payload]:
        raise NotImplementedError

    def exchange_many(self, payloads: list[Payload], names: list[str], consume: bool = False) -> list[list[Payload]]:
        """Exchange several payloads at once: they travel as one payload (their tensors
        concatenated into one list), so one size exchange and one data collective serve the
        whole group. Returns, per payload, what :meth:`exchange` would have returned."""
        if len(payloads) == 1:
            return [self.exchange(payloads[0], names[0])]
        return regroup(payloads, self.exchange([t for payload in payloads for t in payload], ",".join(names)))

    def combine(self, exchanged: list[Payload]) -> Payload:
        """One tensor's exchanged payloads summed over ranks (what ``next_round`` sees)."""
        return [torch.stack(parts).sum(dim=0) for parts in zip(*exchanged)]

    def decompress_exchanged(self, compressor: Compressor, exchanged: list[Payload], ctx: Any, out: Tensor) -> None:
        """One tensor's aggregate from what :meth:`exchange` returned for it, into ``out``."""
        compressor.decompress_aggregate_into(exchanged, ctx, out)

    def aggregate_into(
        self, comp: Compressor, payloads: Payloads, ctxs: Ctxs, names: list[str], outs: Tensors, consume: bool = False
    ) -> Sent:
        if comp.rounds > 1:
            return aggregate_rounds(self, comp, payloads, ctxs, names, outs)
        exchanged = self.exchange_many(payloads, names, consume)
        with phase("decompress"):
            for out, got, ctx in zip(outs, exchanged, ctxs):
                self.decompress_exchanged(comp, got, ctx, out)
        return payloads, ctxs


def regroup(payloads: list[Payload], exchanged: list[Payload]) -> list[list[Payload]]:
    """Split what one exchange of the payloads' concatenated tensors returned (one list per
    rank, or one summed list) back into, per payload, the list :meth:`exchange` returns."""
    out, start = [], 0
    for payload in payloads:
        out.append([tensors[start : start + len(payload)] for tensors in exchanged])
        start += len(payload)
    return out
