"""Methods that exchange several rounds per step (PowerSGD: P, then Q).

A compressor with ``rounds > 1`` sees each round's payloads summed over ranks
(``Compressor.next_round``) and answers with the next round's payload, or None once the
tensor is done. :func:`aggregate_rounds` drives that loop for a fusion group over any
:class:`~grace_dgc.communicators.exchange.ExchangeCommunicator`:

1. exchange every tensor's round-1 payload (one collective for the group);
2. for each tensor still active: ``next_round(Σ_r payload_r, ctx)``; None retires it, with
   its last exchange kept for decompression;
3. exchange the active tensors' next payloads together; repeat 2–3 (at most ``rounds``);
4. decompress each tensor's last exchange into its output; the memory then counts each
   tensor's own payload of its last round as sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from .stats import phase

if TYPE_CHECKING:
    from .communicators.exchange import ExchangeCommunicator
    from .interfaces import Compressor, Payload


def aggregate_rounds(
    communicator: ExchangeCommunicator,
    compressor: Compressor,
    payloads: list[Payload],
    ctxs: list[Any],
    names: list[str],
    outputs: list[Tensor],
) -> tuple[list[Payload], list[Any]]:
    """:meth:`~grace_dgc.interfaces.Communicator.aggregate_into` for a multi-round method:
    returns each tensor's payload and ctx of its last round."""
    payloads, ctxs = list(payloads), list(ctxs)
    exchanged = communicator.exchange_many(payloads, names)  # 1.
    active, rounds = list(range(len(payloads))), 1
    while active:
        following = {}
        with phase("compress"):  # 2.
            for i in active:
                step = compressor.next_round(communicator.combine(exchanged[i]), ctxs[i])
                if step is not None:  # None: the round just exchanged was this tensor's last
                    following[i] = step
        if following and rounds == compressor.rounds:
            raise RuntimeError(
                f"{type(compressor).__name__}.next_round asked for more than rounds={compressor.rounds} exchanges"
            )
        active = sorted(following)
        for i in active:
            payloads[i], ctxs[i] = following[i]
        if active:  # 3.
            again = communicator.exchange_many([payloads[i] for i in active], [names[i] for i in active])
            for i, got in zip(active, again):
                exchanged[i] = got
            rounds += 1
    with phase("decompress"):  # 4.
        for out, got, ctx in zip(outputs, exchanged, ctxs):
            communicator.decompress_exchanged(compressor, got, ctx, out)
    return payloads, ctxs
