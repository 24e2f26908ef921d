"""The α-β cost model of one gradient exchange, per communicator.

The model (Hockney 1994; Thakur et al. 2005; Chan et al. 2007) prices a collective on N ranks
by two link figures:

- α, seconds per collective step: the latency of one message round (one hop of a ring, one
  level of a tree), paid once per step whatever the size;
- β, seconds per byte on a rank's busiest link direction (8 / bandwidth in bits per second):
  a step's bytes travel in parallel on every link, so the time is that of the rank that sends
  (or receives) the most.

An exchange then takes ``α · steps(N) + β · bytes(N, n, D)`` seconds, where n is one rank's
payload in bytes and D the dense fp32 bytes of the same gradients. Per communicator (one
exchange; N = 1 costs nothing):

    communicator                   steps(N)                          bytes(N, n, D)
    allreduce (ring)               2(N−1)                            2(N−1)/N · n
    allgather (sizes, then data)   2(N−1)                            (N−1) · n
    broadcast (each rank in turn)  (N−1) + N·⌈log2 N⌉                N · n
    sparse_allreduce               4(N−1)                            (N−1)/N · (n + min(N·n, D))
    sparse_allreduce+global_topk   4(N−1) + 4·2(N−1)                 2(N−1)/N · n
    reduce_scatter                 4(N−1)                            2(N−1)/N · n

``sparse_allreduce`` sends each owner its pairs and gets the summed regions back, sparse or
dense when that is smaller (the union of N payloads taken as disjoint: an upper bound);
its gTop-k mode adds up to :data:`RADIX_ROUNDS` histogram allreduces to find the global
threshold, then only about one payload of kept pairs comes back; ``reduce_scatter`` sends
chunks to their owners and gets the requantized chunks back (sizes, then data, both ways:
four collectives). The broadcast's steps are the size-header allgather's N−1 plus N
pipelined tree broadcasts of ⌈log2 N⌉ hops each.

The model ignores compute/communication overlap, congestion and stragglers. It is used by
the ``auto`` communicator (:mod:`grace_dgc.communicators.auto`) to choose per bucket, and
by ``grace-dgc project`` (:mod:`grace_dgc.survey.project`) to project a survey's measured
figures to N nodes.
"""

from __future__ import annotations

import math

from .errors import GraceConfigError

__all__ = ["AGGREGATING", "GTOPK", "MODELLED", "RADIX_ROUNDS", "collective_steps", "wire_bytes"]

GTOPK = "sparse_allreduce+global_topk"  # sparse_allreduce(global_topk=True)
AGGREGATING: tuple[str, ...] = ("sparse_allreduce", GTOPK, "reduce_scatter")
MODELLED: tuple[str, ...] = ("allreduce", "allgather", "broadcast", *AGGREGATING)
RADIX_ROUNDS = 4  # gTop-k's threshold search on fp32 sums: up to 4 histogram allreduces


def collective_steps(communicator: str, nodes: int) -> int:
    """Latency steps (α) of one exchange in the model."""
    if nodes <= 1:
        return 0
    if communicator == "allreduce":
        return 2 * (nodes - 1)
    if communicator == "allgather":
        return 2 * (nodes - 1)
    if communicator == "broadcast":
        return (nodes - 1) + nodes * math.ceil(math.log2(nodes))
    if communicator == GTOPK:
        return 4 * (nodes - 1) + RADIX_ROUNDS * 2 * (nodes - 1)
    if communicator in AGGREGATING:
        return 4 * (nodes - 1)
    raise GraceConfigError(f"no cost model for communicator {communicator!r}; accepted: {', '.join(MODELLED)}")


def wire_bytes(communicator: str, nodes: int, nbytes: float, dense_bytes: float) -> float:
    """Bytes on one rank's busiest link direction for one step's payload of ``nbytes``."""
    if nodes <= 1:
        return 0.0
    share = (nodes - 1) / nodes
    if communicator == "allreduce":
        return 2 * share * nbytes
    if communicator == "allgather":
        return (nodes - 1) * nbytes
    if communicator == "broadcast":
        return nodes * nbytes
    if communicator == "sparse_allreduce":
        return share * (nbytes + min(nodes * nbytes, dense_bytes))
    if communicator in ("reduce_scatter", GTOPK):
        return 2 * share * nbytes
    raise GraceConfigError(f"no cost model for communicator {communicator!r}; accepted: {', '.join(MODELLED)}")
