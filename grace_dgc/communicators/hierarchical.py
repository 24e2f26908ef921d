from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import environment
from ..engines.base import Engine
from ..engines.nodes import NodesView
from ..errors import GraceConfigError, check_range
from ..interfaces import Communicator, Compressor, Ctxs, Payloads, Sent, Tensors
from ..registry import COMMUNICATORS, register_communicator


@register_communicator("hierarchical")
class Hierarchical(Communicator):
    """Dense reduction inside a node, compressed exchange between nodes (outer=), result broadcast in the node

    ByteGrad in Bagua; the DGC paper's "future work". ``outer`` is any flat communicator.

    Ranks form nodes of ``group_size`` consecutive ranks (default: torchrun's
    ``LOCAL_WORLD_SIZE``, so one node per machine; ``group_size=2`` lets one machine
    emulate nodes of 2). Rank 0 of each node is its leader. Per fusion group:

    1. node sum: s_n = Σ_{r ∈ node n} g_r  (a dense allreduce inside the node: NVLink or
       shared memory, where compressing costs more than it saves);
    2. every rank of the node runs the memory and compressor on s_n (all compute the same
       thing with the node's random stream, so it costs no wall time and a node's ranks keep
       equal state); only the leaders exchange, with ``outer`` over the M nodes:
       ĝ = agg_n D(C(s_n + e_n))  (the sum for averaging methods, the vote of the nodes for
       majority-vote ones); the compressor and memory see a world of M ranks;
    3. the leader broadcasts ĝ inside its node, and Grace divides by the world size N.

    Traffic between nodes is that of ``outer`` among M leaders: compression pays once per
    node instead of once per GPU. Needs subgroups: torch.distributed (new_group) or Horovod
    with dynamic process sets.
    """

    SETTINGS = ("outer", "group_size")
    STATE = ("outer",)  # the outer communicator's own (reduce_scatter's owner errors)

    def __init__(self, engine: Engine, outer: str = "allgather", group_size: int | None = None) -> None:
        super().__init__(engine)
        try:
            self.outer_name = COMMUNICATORS.canonical(outer)
        except GraceConfigError as error:  # say where the name came from
            raise GraceConfigError(f"hierarchical(outer={outer!r}): {error}") from error
        if self.outer_name == "hierarchical":
            raise GraceConfigError("hierarchical(outer='hierarchical') nests itself; pick a flat outer communicator")
        if group_size is not None:
            check_range("group_size", group_size, 1, kind=int)
        self.group_size = group_size
        self.outer: Communicator | None = None  # made by setup, over the leaders

    def refuse(self, compressor: Compressor) -> str | None:
        own = super().refuse(compressor)  # multi-round methods (PowerSGD): not between nodes
        if own:
            return own
        reason = COMMUNICATORS.get(self.outer_name).refusal(compressor)
        return f"its outer communicator {self.outer_name!r} refuses it ({reason})" if reason else None

    def agreed_settings(self) -> dict[str, Any]:
        """The group size in effect (LOCAL_WORLD_SIZE's, when not given): ranks that read
        another one from their environment would form other nodes."""
        try:
            size: Any = self._group_size()
        except GraceConfigError as error:  # the ranks learn of it together at the handshake
            size = f"invalid ({str(error).split(';')[0]})"
        return {"outer": self.outer_name, "group_size": size}

    def _group_size(self) -> int:
        return self.group_size or _local_world_size(self.engine.size)

    def setup(self) -> Engine:
        engine = self.engine
        size = self._group_size()
        if engine.size % size:
            raise GraceConfigError(
                f"hierarchical: {engine.size} ranks do not form nodes of group_size={size}; "
                f"pass a group_size that divides {engine.size}"
            )
        nodes = engine.size // size
        node = engine.split([list(range(n * size, (n + 1) * size)) for n in range(nodes)])
        assert node is not None  # every rank is in one node
        self.node = node
        cross = engine.split([[n * size for n in range(nodes)]])
        self.leader = cross is not None
        self.nodes_view = NodesView(engine.rank // size, nodes, engine.name)
        self.outer = COMMUNICATORS.get(self.outer_name)(cross if cross is not None else self.nodes_view)
        self.outer.setup()  # (auto: its members; the leaders measure the link between them)
        return self.nodes_view

    def wire_compressor(self, compressor: Compressor) -> Compressor:
        assert self.outer is not None
        return self.outer.wire_compressor(compressor)

    def prereduce(self, tensors: list[Tensor], names: list[str]) -> list[Tensor]:
        assert self.outer is not None
        if self.leader:  # before the node's sum, so every rank of the node compresses the same s_n
            tensors = self.outer.prereduce(tensors, names)  # (auto: a stranded owner error)
        sums: list[Tensor] = [t for t in tensors]
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = self.node.allreduce(torch.cat([tensors[i].reshape(-1) for i in members]))
            for i, part in zip(members, flat.split([tensors[i].numel() for i in members])):
                sums[i] = part.view(tensors[i].shape)
        return sums

    def aggregate_into(
        self, comp: Compressor, payloads: Payloads, ctxs: Ctxs, names: list[str], outs: Tensors, consume: bool = False
    ) -> Sent:
        outer, sent = self.outer, (payloads, ctxs)
        assert outer is not None
        if self.leader:
            sent = outer.aggregate_into(comp, payloads, ctxs, names, outs)
        plan = outer.plan(names)
        if plan is not None:  # the node's other ranks compress the next step as their leader decided
            plan = self.node.broadcast(plan.to(outs[0].device), 0)
            if not self.leader:
                outer.plan(names, adopt=plan.cpu())
        for dtype in dict.fromkeys(o.dtype for o in outs):  # 3. the leader's result to its node
            members = [i for i, o in enumerate(outs) if o.dtype == dtype]
            flat = torch.cat([outs[i].reshape(-1) for i in members])
            self.node.broadcast(flat, 0)
            for i, part in zip(members, flat.split([outs[i].numel() for i in members])):
                outs[i].view(-1).copy_(part)
        return sent

    def state_dict(self) -> dict[str, Any]:
        if self.outer is None:
            raise GraceConfigError("hierarchical has no state before it is set up (Grace binds it first)")
        return super().state_dict()


def _local_world_size(default: int) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` (ranks per machine), checked: a launcher or a user
    setting it by hand gets a named error, not a ValueError or a division by zero."""
    size = environment.read_int("LOCAL_WORLD_SIZE", default, low=1)
    assert size is not None
    return size
