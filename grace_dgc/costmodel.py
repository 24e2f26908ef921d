"""The α-β cost model of one gradient exchange, per communicator.

The model (Hockney 1994; Thakur et al. 2005; Chan et al. 2007) prices a collective on N ranks
by two link figures:

- α, seconds per collective step: the latency of one message round (one hop of a ring, one
  level of a tree), paid once per step whatever the size;
- β, seconds per byte on a rank's busiest link direction (8 / bandwidth in bits per second):
  a step's bytes travel in parallel on every link, so the time is that of the rank that sends
  (or receives) the most.

An exchange then takes ``α · steps(N) + β · bytes(N, n, D)`` seconds, where n is one rank's
payload in bytes and D the dense fp32 bytes of the same gradients. Each communicator declares
its own terms (:meth:`grace_dgc.interfaces.Communicator.cost`, read through :func:`cost`), so
a plugin communicator that declares them takes part in ``auto`` and ``grace-dgc project`` as
the built-ins do. The built-ins' (one exchange; N = 1 costs nothing):

    communicator                   steps(N)                          bytes(N, n, D)
    allreduce (ring)               2(N−1)                            2(N−1)/N · n
    allgather (sizes, then data)   2(N−1)                            (N−1) · n
    broadcast (each rank in turn)  (N−1) + N·⌈log2 N⌉                N · n
    sparse_allreduce               4(N−1)                            (N−1)/N · (n + min(N·n, D))
    sparse_allreduce+global_topk   4(N−1) + 4·2(N−1)                 2(N−1)/N · n
    reduce_scatter                 4(N−1)                            2(N−1)/N · n

``sparse_allreduce`` sends each owner its pairs and gets the summed regions back, sparse or
dense when that is smaller (the union of N payloads taken as disjoint: an upper bound);
its gTop-k mode adds up to four histogram allreduces to find the global
threshold, then only about one payload of kept pairs comes back; ``reduce_scatter`` sends
chunks to their owners and gets the requantized chunks back (sizes, then data, both ways:
four collectives). The broadcast's steps are the size-header allgather's N−1 plus N
pipelined tree broadcasts of ⌈log2 N⌉ hops each.

The model ignores compute/communication overlap, congestion and stragglers. It is used by
the ``auto`` communicator (:mod:`grace_dgc.communicators.auto`) to choose per bucket, and
by ``grace-dgc project`` to project measured figures to N nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import GraceConfigError

if TYPE_CHECKING:
    from .interfaces import Communicator, Cost

__all__ = ["GTOPK", "collective_steps", "cost", "declared", "modelled", "wire_bytes"]

GTOPK = "sparse_allreduce+global_topk"  # sparse_allreduce(global_topk=True)


def declared(communicator: str) -> tuple[type[Communicator], dict[str, Any]]:
    """The class whose :meth:`~grace_dgc.interfaces.Communicator.cost` prices ``communicator``
    and the settings it is asked with (gTop-k is a mode of sparse_allreduce)."""
    from .registry import COMMUNICATORS

    if communicator == GTOPK:
        return COMMUNICATORS.get("sparse_allreduce"), {"global_topk": True}
    return COMMUNICATORS.get(communicator), {}


def modelled() -> tuple[str, ...]:
    """Every communicator with a declared cost (registered plugins included), and gTop-k."""
    from .registry import COMMUNICATORS

    names = [name for name in COMMUNICATORS.names() if COMMUNICATORS.get(name).cost(2, 1.0, 1.0) is not None]
    return (*names, GTOPK) if "sparse_allreduce" in names else tuple(names)


def cost(communicator: str, nodes: int, nbytes: float, dense_bytes: float) -> Cost:
    """One exchange's :class:`~grace_dgc.interfaces.Cost` on ``nodes`` ranks, as
    ``communicator`` declares it (nothing on one rank)."""
    from .interfaces import Cost

    try:
        cls, settings = declared(communicator)
        terms = None if nodes <= 1 else cls.cost(nodes, nbytes, dense_bytes, **settings)
    except GraceConfigError:
        terms = None
    if nodes <= 1:
        return Cost(0, 0.0, 0.0, 0.0)
    if terms is None:
        raise GraceConfigError(
            f"no cost model for communicator {communicator!r} (a communicator declares one with a cost() "
            f"classmethod); modelled: {', '.join(modelled())}"
        )
    return terms


def collective_steps(communicator: str, nodes: int) -> int:
    """Latency steps (α) of one exchange in the model."""
    return int(cost(communicator, nodes, 0.0, 0.0).steps)


def wire_bytes(communicator: str, nodes: int, nbytes: float, dense_bytes: float) -> float:
    """Bytes on one rank's busiest link direction for one step's payload of ``nbytes``."""
    return float(cost(communicator, nodes, nbytes, dense_bytes).wire)
