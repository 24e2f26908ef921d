"""Training that survives a lost replica group: a way in under torchft's ``Manager``.

torchft (``pip install 'grace_dgc[torchft]'``) keeps a job going when a replica group dies: a
lighthouse keeps the quorum, each group's ``Manager`` reconfigures the process group over the
groups alive, and a group that comes back receives a healthy peer's state. :func:`fault_tolerant`
puts a DistributedOptimizer, an outer-loop schedule (Streaming DiLoCo too), 1-bit Adam or 0/1 Adam under
a Manager::

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), use_async_quorum=False, min_replica_size=1,
                              load_state_dict=None, state_dict=None, replica_id=f"group_{g}", ...)
    grace = grace_dgc.build("topk", "residual", "allgather", engine=TorchFTEngine(manager), compress_ratio=0.01)
    optimizer = grace_dgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grace,
                                               model.named_parameters())
    fault_tolerant(manager, optimizer, model)
    while manager.current_step() < steps:
        optimizer.zero_grad()            # the quorum forms; a group that rejoins takes its peer's state here
        loss_of(model, batch).backward()  # grace's exchanges run on the quorum's process group
        optimizer.step()                  # applied if this group's exchanges went through, else discarded

What each step does (:class:`Quorum`, the way in's coordinator):

1. ``begin`` (the DistributedOptimizer's and 1-bit Adam's ``zero_grad``; an outer-loop
   schedule's ``zero_grad`` or first inner step of a round; 0/1 Adam's ``zero_grad`` at each
   variance step and at the start of each round of local steps; Streaming DiLoCo's before each
   step that sends a fragment, whose exchange then commits when it is applied): ``manager.start_quorum()``. A group
   behind the others (restarted after a loss) receives a healthy peer's state there (the model,
   and the way in's ``state_dict()`` loaded with ``peer=True``). When the quorum is another one,
   each Grace binds and agrees again on the new ranks (a rejoining group with other settings is
   refused by name) and compares what must be equal on every rank (the parameters; a schedule's
   round start), so a heal that left a group apart is an error, not a silent divergence. Grace's
   state is copied.
2. The exchanges run on the Manager's process group (:class:`~grace_dgc.engines.torchft_engine.TorchFTEngine`);
   the average divides by the quorum's participants. A collective that fails is reported to
   the Manager and ends the step's exchanges (:class:`~grace_dgc.errors.StepDiscarded`).
3. ``commit`` (the optimizer's ``step``, a schedule's synchronization): ``manager.should_commit()``.
   Where it is False the step is discarded on this group: nothing applied, grace's state back
   to the copy of 1 (an error feedback that took in a discarded step would carry mass that was
   never applied). torchft's vote is per group, not across groups: a group whose exchanges went
   through applies its step while one that met the failure discards it (a ring broken part way).
   The groups meet again at the next quorum, where the one behind (its step count lags) heals
   from a peer: the same parameters everywhere, and the lagging group's own error feedback
   starts empty (its unsent mass is lost, never sent twice).

What a rejoining group does with grace's state (``Part.REPLICATED``): it adopts what is equal on
every rank (PowerSGD's Q, a shared random stream, step counts, the Adam moments and round start
of a schedule, the optimizers' state) and starts its own error feedback, worker momentum and
owner errors empty: a peer's residual taken over would be sent by two groups, its mass counted
twice. State that holds only for the ranks it was built with (an owner's chunk error; EF21's shared
estimate) is reset on every group when the quorum changes (``Part.RESET_WHEN_RANKS_CHANGE``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..engines.torchft_engine import TorchFTEngine
from ..errors import GraceConfigError, StepDiscarded
from .driver import Coordinator, Driver
from .optimizer import DistributedOptimizer
from .schedules.adam import AdamSchedule
from .schedules.outer import OuterSync
from .schedules.streaming import StreamingDiLoCo

STATE_KEY = "grace_dgc"  # the key of the way in's state among the Manager's state functions


class Quorum(Coordinator):
    """A way in's steps under ``manager`` (see the module): the quorum at :meth:`begin`, the
    vote at :meth:`commit`, a healthy peer's state for a group that rejoins. ``discarded`` and
    ``healed`` count the steps this group discarded and the heals it took."""

    def __init__(self, manager: Any, way: Driver, model: torch.nn.Module) -> None:
        self.manager, self.way, self.model = manager, way, model
        self.graces = [grace for _, grace in way._graces()]
        self.engines = list({id(g.engine): g.engine for g in self.graces}.values())
        self._saved: list[dict[str, Any]] = []
        self._open = False  # between begin and commit
        self.discarded = self.healed = 0

    def begin(self) -> None:
        if self._open:  # a second zero_grad in one step: the step has begun
            return
        self._open, self._saved = True, []
        self.manager.start_quorum()  # a group behind the others heals here (load_from_peer)
        if self.manager.errored() is not None:  # the quorum's set-up or the heal failed: nothing commits
            return
        self._follow_the_quorum()
        try:  # on a new quorum the Graces bind first: the ranks agree on their settings and replicas
            self._saved = [grace.state_dict() for grace in self.graces]
        except StepDiscarded:  # a group was lost as the quorum formed: nothing changed, nothing commits
            self._saved = []

    def commit(self) -> bool:
        if not self._open:
            raise GraceConfigError(
                f"{self.way.name} under torchft: call zero_grad() before each step's forward pass (the quorum "
                "forms there, and a group that rejoins takes its peer's state before it computes a gradient)"
            )
        self._open = False
        if self.manager.should_commit():
            return True
        self.discarded += 1
        for grace, saved in zip(self.graces, self._saved):  # as at begin: the discarded step left no trace
            grace.load_state_dict(saved)
        return False

    def _follow_the_quorum(self) -> None:
        """Another quorum than the last: the Graces bind and agree again on its ranks."""
        changed = [engine.refresh() for engine in self.engines]  # type: ignore[attr-defined]  # every one
        if any(changed):
            # as they are now, where every group holds them alike (a heal just made them so): a Grace's
            # next exchange may come after local steps (0/1 Adam's compressed one: at its first round's end)
            replicas = {name: tensor.detach().clone() for name, tensor in self.way.replicas().items()}
            for grace in self.graces:
                grace.ranks_changed(replicas)

    def state_for_peer(self) -> dict[str, Any]:
        """What a healthy group sends one that rejoins: copies of the model and of the way in's state
        (torchft's transport serializes them when the peer reads them), taken without binding a Grace
        (this runs on torchft's quorum thread: no collective may start here)."""
        return copy.deepcopy({"model": self.model.state_dict(), "way": self.way.state_dict(peer=True)})

    def load_from_peer(self, state: dict[str, Any]) -> None:
        """A group behind the others (restarted after a loss, or one whose step did not commit where
        the others' did) takes a healthy peer's state, then the quorum's ranks (what it compares
        across them is the peer's by then)."""
        self.model.load_state_dict(state["model"])
        self.way.load_state_dict(state["way"], peer=True)
        self.healed += 1
        self._follow_the_quorum()


def fault_tolerant(manager: Any, way: Driver, model: torch.nn.Module) -> Quorum:
    """Run ``way`` (a :class:`DistributedOptimizer`, an outer-loop schedule: DiLoCo, local
    SGD, SparseLoCo, Streaming DiLoCo; 1-bit Adam or 0/1 Adam) under torchft's ``manager``: its
    Graces exchange on the Manager's process group (build them with
    ``engine=TorchFTEngine(manager)``), its steps begin with the quorum
    and commit by the groups' vote, and a group that rejoins takes a healthy peer's state (the
    module's docstring). Registers the state functions with the Manager (give it
    ``load_state_dict=None, state_dict=None``). Returns the coordinator the way in now uses."""
    if not isinstance(way, (DistributedOptimizer, OuterSync, AdamSchedule)):
        raise GraceConfigError(
            "fault_tolerant runs a DistributedOptimizer, an outer-loop schedule (diloco, local_sgd, sparseloco, "
            f"streaming_diloco), onebit_adam or zero_one_adam; got {getattr(way, 'name', type(way).__name__)}"
        )
    if isinstance(way, StreamingDiLoCo) and way.delay >= way.steps_between_sends():
        raise GraceConfigError(
            f"Streaming DiLoCo under torchft: delay={way.delay} overlaps one fragment's exchange with the next one's "
            f"(sends {way.steps_between_sends()} inner steps apart); each exchange is a step of the quorum, voted on "
            "before the next begins: give delay < inner_steps / fragments"
        )
    graces = [grace for _, grace in way._graces()]
    foreign = [g for g in graces if not (isinstance(g.engine, TorchFTEngine) and g.engine.manager is manager)]
    if foreign:
        raise GraceConfigError(
            f"the Grace of {way.name} exchanges on engine {foreign[0].engine.name!r}; under torchft build it with "
            "engine=grace_dgc.engines.torchft_engine.TorchFTEngine(manager), the same Manager"
        )
    quorum = Quorum(manager, way, model)
    manager.register_state_dict_fn(STATE_KEY, quorum.load_from_peer, quorum.state_for_peer)
    way.coordinator = quorum
    return quorum


def group_manager(replica_id: str, lighthouse: str, *, timeout: float = 10.0, quorum_timeout: float = 60.0) -> Any:
    """A torchft ``Manager`` for one replica group of one rank, as grace runs under torchft: a
    synchronous quorum (a healing group has its peer's state before the step), gloo with a
    ``timeout``-second collective limit, its own TCP store, state functions left to
    :func:`fault_tolerant`, and any number of groups down to one (``min_replica_size=1``)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=replica_id,
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="localhost",
        timeout=timedelta(seconds=2 * timeout),
        quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=2 * timeout),
    )
    manager._grace_store = store  # the group's store server lives as long as its Manager (its pg meets there)
    return manager
