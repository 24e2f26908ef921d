"""The three small interfaces every method implements (GRACE-compatible).

A *payload* is the list of tensors a compressor puts on the wire; *ctx* is whatever
it needs locally to decompress them. ``ctx`` must not depend on the rank, because a
rank decompresses every other rank's payload with its own ctx.

Aliasing: a payload may alias the tensor given to ``compress`` (``none`` sends the tensor
itself) but never a compressor's scratch workspace, and ``compress`` never writes to its
input. ``decompress`` returns a tensor the caller owns; ``decompress_into`` writes into the
caller's ``out``.
"""

from __future__ import annotations

import inspect
import random
import warnings
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .errors import GraceConfigError
from .workspace import Workspace

if TYPE_CHECKING:
    from .engines.base import Engine

Payload = list[Tensor]  # the tensors one compressor puts on the wire for one gradient
# a fusion group on the data path: per tensor, its payload, its ctx, its output
Payloads = list[Payload]
Ctxs = list[Any]
Tensors = list[Tensor]
Sent = tuple[Payloads, Ctxs]  # per tensor, what the memory counts as sent (payload, ctx)


class StateMismatch(GraceConfigError):
    """A state that lacks what a part keeps (saved by another method or version)."""


class Part:
    """What every compressor, memory and communicator declares about itself, in one place;
    the handshake, the checkpoint and the skip of a non-finite step all read it:

    ``SETTINGS``: attributes every rank must share (:meth:`agreed_settings`). The ranks
        compare them before they set up and before each group's first exchange; a
        checkpoint records them and a load compares them.
    ``STATE``: attributes that live across steps. :meth:`state_dict`, :meth:`load_state_dict`,
        :meth:`reset` (dicts keyed by tensor name) and :meth:`snapshot`/:meth:`restore`
        derive from it; an attribute may hold a part (or a dict of parts), whose own state
        nests.
    ``RANK_LOCAL``: constructor parameters and long-lived attributes in neither, each with
        why (scratch buffers, what a rank was handed by the optimizer).
    ``RESUME_MAY_DIFFER``: settings a checkpoint may carry other values of, with why.
    ``REPLICATED``: the ``STATE`` attributes that are equal on every rank (PowerSGD's Q, a
        random stream all ranks share, a step count). A rank that rejoins a fault-tolerant job
        takes them from a healthy peer (:meth:`heal`); the rest of its state is its own (error
        feedback, a worker's momentum, an owner's chunk error) and starts empty: adopting a
        peer's would send that peer's gradient mass a second time.
    ``RESET_WHEN_RANKS_CHANGE``: True where the state is only right for the ranks it was built
        with (an owner's error on its chunk of N; EF21's shared estimate, the mean of every
        rank's own): every rank resets it when the ranks change (:meth:`ranks_changed`).

    ``tests/core/test_declarations.py`` walks every registered part and fails on a constructor
    parameter or a tensor kept across steps that none of these names.
    """

    SETTINGS: ClassVar[tuple[str, ...]] = ()
    STATE: ClassVar[tuple[str, ...]] = ()
    RANK_LOCAL: ClassVar[dict[str, str]] = {}
    RESUME_MAY_DIFFER: ClassVar[dict[str, str]] = {}
    REPLICATED: ClassVar[tuple[str, ...]] = ()
    RESET_WHEN_RANKS_CHANGE: ClassVar[bool] = False

    def agreed_settings(self) -> dict[str, Any]:
        """The values of ``SETTINGS``, as the ranks compare them (effective values: a
        default taken from the environment is read here)."""
        return {key: getattr(self, key) for key in self.SETTINGS}

    def state_dict(self) -> dict[str, Any]:
        """Copies of ``STATE``: plain tensors, numbers, strings and containers (loads with
        ``torch.load(..., weights_only=True)``)."""
        return {key: _saved(getattr(self, key)) for key in self.STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in self.STATE if key not in state]
        if missing:
            raise StateMismatch(
                f"{_name(self)}: the state lacks {', '.join(missing)} (it holds "
                f"{', '.join(sorted(state)) or 'nothing'}); {_name(self)} keeps {', '.join(self.STATE)}"
            )
        for key in self.STATE:
            setattr(self, key, _loaded(getattr(self, key, None), state[key]))

    def reset(self, name: str | None = None) -> None:
        """Forget what was kept, for every tensor or only ``name``'s (deliberately, e.g.
        after changing the model); the next step starts from zero state."""
        for key in self.STATE:
            _forget(getattr(self, key), name)

    def heal(self, peer: dict[str, Any]) -> None:
        """Take a healthy peer's :meth:`state_dict` as a rank that rejoins: the ``REPLICATED``
        attributes become the peer's, the others start empty (a nested part decides for its own)."""
        if self.STATE and set(self.STATE) <= set(self.REPLICATED):
            self.load_state_dict(peer)  # all of it is shared: the part's own load (DGC's random stream)
            return
        for key in self.STATE:
            current = getattr(self, key, None)
            if isinstance(current, Part):
                current.heal(peer[key])
            elif isinstance(current, dict) and current and all(isinstance(v, Part) for v in current.values()):
                for name, part in current.items():
                    part.heal(peer[key][name])
            elif key in self.REPLICATED:
                setattr(self, key, _loaded(current, peer[key]))
            else:
                _forget(current, None)

    def ranks_changed(self) -> None:
        """The ranks exchanging are others now (a fault-tolerant job's new quorum): forget what
        only held for the old ones (``RESET_WHEN_RANKS_CHANGE``), in this part and the parts it holds."""
        if self.RESET_WHEN_RANKS_CHANGE:
            self.reset()
            return
        for key in self.STATE:
            value = getattr(self, key, None)
            for part in value.values() if isinstance(value, dict) else [value]:
                if isinstance(part, Part):
                    part.ranks_changed()

    def snapshot(self, names: Sequence[str]) -> dict[str, Any]:
        """Copies of the state kept for ``names`` (and of the state kept for no tensor):
        Grace takes one before a step that may still be skipped after the state changed."""
        return {key: _snapshot(getattr(self, key), names) for key in self.STATE}

    def restore(self, snapshot: dict[str, Any], names: Sequence[str]) -> None:
        """Put back what :meth:`snapshot` copied: ``names``' state is bitwise as it was."""
        for key, saved in snapshot.items():
            setattr(self, key, _restored(getattr(self, key), saved, names))

    def undeclared_state(self) -> list[str]:
        """Attributes (of this part and of the parts it holds) that keep tensors or random
        streams across steps but are declared neither ``STATE`` nor ``RANK_LOCAL``: a
        checkpoint, a skipped step and ``reset`` would silently miss them. Grace warns about
        them after a group's first exchange (a plugin that overrides ``state_dict`` and
        ``reset`` handles its state itself and is not asked)."""
        own = type(self)
        if own.state_dict is not Part.state_dict and own.reset is not Part.reset:
            return []
        found = []
        for attribute, value in vars(self).items():
            if isinstance(value, Part):
                found += [f"{attribute}.{inner}" for inner in value.undeclared_state()]
            elif _keeps(value) and attribute not in self.STATE and attribute not in self.RANK_LOCAL:
                found.append(attribute)
        return found

    def state_numels(self, key: str, shape: torch.Size) -> Collection[int] | None:
        """The element counts the entry of per-tensor state ``key`` may hold for a tensor of
        ``shape`` (None: any). A checkpoint's shape check reads it, so that a differently
        shaped model is refused and every legitimate state loads. Default: the tensor's own
        (a residual); PowerSGD's Q (m × r) and reduce_scatter's owner chunk say otherwise."""
        return (shape.numel(),)

    def shape_problems(self, state: Any, shapes: dict[str, torch.Size], where: str) -> list[str]:
        """What in ``state`` (this part's :meth:`state_dict` as saved) does not fit tensors
        of ``shapes`` (name -> shape), per :meth:`state_numels`; nested parts answer for theirs."""
        problems: list[str] = []
        if not isinstance(state, dict):
            return problems
        for key in self.STATE:
            current, saved = getattr(self, key, None), state.get(key)
            if isinstance(current, Part):
                problems += current.shape_problems(saved, shapes, f"{where}[{key!r}]")
            elif isinstance(current, dict) and current and all(isinstance(v, Part) for v in current.values()):
                for inner, part in current.items():
                    saved_inner = saved.get(inner) if isinstance(saved, dict) else None
                    problems += part.shape_problems(saved_inner, shapes, f"{where}[{key!r}][{inner!r}]")
            elif isinstance(saved, dict):
                for name, value in saved.items():
                    if name not in shapes or not isinstance(value, Tensor):
                        continue
                    expected = self.state_numels(key, shapes[name])
                    if expected is not None and value.numel() not in expected:
                        problems.append(
                            f"{where}[{key!r}][{name!r}]: {value.numel()} elements for {tuple(shapes[name])} "
                            f"(accepted: {' or '.join(map(str, sorted(set(expected))))})"
                        )
        return problems

    # -- optional hooks: no-ops unless a part needs them ----------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The current epoch, from ``Grace.set_epoch`` (e.g. DGC's warm-up)."""

    def stats(self) -> dict[str, Any]:
        """Part-specific figures merged into ``Grace.stats()`` (DGC's current ratio, auto's
        choices)."""
        return {}


def _keeps(value: Any) -> bool:
    """Does ``value`` hold something that lives across steps (a tensor, a random stream)?"""
    if isinstance(value, (Tensor, torch.Generator, random.Random)):
        return True
    if isinstance(value, dict):
        return any(_keeps(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_keeps(v) for v in value)
    return False


def _name(part: Any) -> str:
    return getattr(part, "registered_name", type(part).__name__)


def _saved(value: Any) -> Any:
    if isinstance(value, Part):
        return value.state_dict()
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _saved(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_saved(v) for v in value)
    return value


def _loaded(current: Any, saved: Any) -> Any:
    if isinstance(current, Part):
        current.load_state_dict(saved)
        return current
    if isinstance(current, dict) and current and all(isinstance(v, Part) for v in current.values()):
        if sorted(current) != sorted(saved):
            raise StateMismatch(f"the state holds parts {sorted(saved)}; this one has {sorted(current)}")
        for key, part in current.items():
            part.load_state_dict(saved[key])
        return current
    return _saved(saved)  # copies: the caller's dict stays theirs


def _forget(value: Any, name: str | None) -> None:
    if isinstance(value, Part):
        value.reset(name)
    elif isinstance(value, dict) and value and all(isinstance(v, Part) for v in value.values()):
        for part in value.values():
            part.reset(name)
    elif isinstance(value, dict):
        if name is None:
            value.clear()
        else:
            value.pop(name, None)


def _per_tensor(value: Any) -> bool:
    """A dict of tensors keyed by tensor name (a residual per gradient)."""
    return isinstance(value, dict) and all(isinstance(v, Tensor) for v in value.values())


def _snapshot(value: Any, names: Sequence[str]) -> Any:
    if isinstance(value, Part):
        return value.snapshot(names)
    if isinstance(value, dict) and value and all(isinstance(v, Part) for v in value.values()):
        return {key: part.snapshot(names) for key, part in value.items()}
    if _per_tensor(value):
        return {name: value[name].clone() for name in names if name in value}
    return _saved(value)


def _restored(current: Any, saved: Any, names: Sequence[str]) -> Any:
    if isinstance(current, Part):
        current.restore(saved, names)
        return current
    if isinstance(current, dict) and current and all(isinstance(v, Part) for v in current.values()):
        for key, part in current.items():
            part.restore(saved[key], names)
        return current
    if _per_tensor(current):
        for name in names:
            current.pop(name, None)
        current.update(saved)
        return current
    return saved


class Compressor(Part):
    """``compress(tensor, name) -> (payload, ctx)``; ``decompress(payload, ctx) -> tensor``.

    Class attributes (the safe value is the default: a plugin declares what it allows):
      summable: two ranks' payloads may be summed elementwise (only then is allreduce valid).
      average:  divide the aggregate by the world size (False for majority vote).
      elementwise: compress and decompress act element by element with a ctx that depends on
                the dtype only (none, fp16, bf16), so Grace may compress a fusion bucket's flat
                buffer as one tensor instead of its tensors one by one.
      sparse:   the payload is ``[values, indices]`` (int32 indices into the flattened tensor,
                each at most once) and ``decompress`` scatters the values into zeros, so
                payloads can be summed index by index (``sparse_allreduce``); ctx is a
                :class:`~grace_dgc.compressors.sparse.SparseContext` (DGC's tensors sent whole
                say so in it).
      chunkable: compressing the chunks of a tensor one by one is still the method (true of
                quantizers, false of selections over the whole tensor): ``reduce_scatter``
                and ``auto`` chunk only a compressor that declares it.
      sends_all: every element travels (a quantizer, a cast), even one that decodes to 0:
                ``sent_mask`` is then all True and ``mask_sent_`` zeroes the whole tensor.
      rounds:   the most exchanges per tensor. With rounds > 1 (PowerSGD) the exchange calls
                ``next_round`` with each round's payload summed over ranks, the last round
                included (:mod:`grace_dgc.rounds`); it returns the next payload, or None once
                the tensor is done. Such payloads must be summable (with any communicator).
      may_overflow: a finite input may come out of the exchange as Inf (fp16's ±65504):
                Grace then copies the state a step changes, so a skipped step restores it.
      biased:   E[D(C(x))] ≠ x, by design (sparsifiers, sign methods, low rank): such a method
                is meant to run with error feedback, and error feedback feeding an optimizer
                with per-coordinate moments (Adam …) is known to fail (Grace warns once).
      prerounds: the method agrees on something with the other ranks before it compresses
                (THC's global scale: one small collective per fusion group), in
                :meth:`preround`. Such a method runs under the exchange communicators
                (allreduce, allgather, broadcast), whose ranks all compress the same tensors.
    """

    registered_name: ClassVar[str]  # set by the registry's decorator
    RANK_LOCAL: ClassVar[dict[str, str]] = {
        "_workspace": "scratch buffers of one call, never part of a payload or of the state"
    }

    summable = False
    average = True
    rounds = 1
    elementwise = False
    sparse = False
    chunkable = False
    sends_all = False
    may_overflow = False
    prerounds = False
    biased = False

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        raise NotImplementedError

    def next_round(self, summed_payload: Payload, ctx: Any) -> tuple[Payload, Any] | None:
        """``(payload, ctx)`` of the next round, given the round just exchanged summed over
        ranks; or None when that round was the last (its payloads are then decompressed with
        ``ctx``, and the memory is updated with this rank's payload of that round). Seeing the
        last sum lets a method keep state that must be equal on all ranks (PowerSGD's Q).
        """
        raise NotImplementedError

    def requantize(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        """Compress an *aggregate* (``reduce_scatter``'s second hop: the owner of a chunk
        re-compresses the ranks' average). Default: :meth:`compress`. A method whose compress
        keeps per-step state (Signum's momentum) or whose aggregate does not fit its format
        (the majority vote's ties) overrides it together with :meth:`dequantize_into`."""
        return self.compress(tensor, name)

    def dequantize_into(self, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """Inverse of :meth:`requantize`, into ``out``. Default: :meth:`decompress_into`."""
        return self.decompress_into(payload, ctx, out)

    def aggregate(self, tensors: Sequence[Tensor]) -> Tensor:
        """Combine the decompressed tensors of all ranks (default: their sum)."""
        return torch.stack(list(tensors)).sum(dim=0) if len(tensors) > 1 else tensors[0]

    def decompress_aggregate(self, payloads: Sequence[Payload], ctx: Any) -> Tensor:
        """``aggregate`` of every rank's decompressed payload. Sparse methods override it to
        add all ranks' values into one dense tensor instead of building one per rank."""
        return self.aggregate([self.decompress(p, ctx) for p in payloads])

    # -- the allocation-free forms the data path uses (defaults: the plain forms + a copy) --
    def decompress_into(self, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """Write ``decompress(payload, ctx)`` into ``out`` (shaped and typed like the
        gradient) and return ``out``. Built-in methods override it to skip the full-size
        temporary; a plugin gets this copying default."""
        return out.copy_(self.decompress(payload, ctx).reshape(out.shape))

    def decompress_aggregate_into(self, payloads: Sequence[Payload], ctx: Any, out: Tensor) -> Tensor:
        """``decompress_aggregate`` written into ``out``; returns ``out``."""
        return out.copy_(self.decompress_aggregate(payloads, ctx).reshape(out.shape))

    def subtract_sent_(self, tensor: Tensor, payload: Payload, ctx: Any) -> Tensor:
        """``tensor -= decompress(payload, ctx)`` in place (the residual of error feedback);
        returns ``tensor``. Sparsifiers subtract at their indices only."""
        scratch = self.workspace.like("decompressed", tensor)
        return tensor.sub_(self.decompress_into(payload, ctx, scratch))

    def sent_mask(self, payload: Payload, ctx: Any) -> Tensor:
        """Bool tensor shaped like the gradient: True where this rank's own payload carried
        the element (used by memories such as ``momentum`` for momentum factor masking).

        Default: all True with ``sends_all``, else ``decompress(payload, ctx) != 0`` (a sent
        exact zero reads as not sent); sparsifiers override it with their exact index set.
        """
        decompressed = self.decompress(payload, ctx)
        return torch.ones_like(decompressed, dtype=torch.bool) if self.sends_all else decompressed != 0

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: Any) -> Tensor:
        """``tensor ⊙ ¬sent_mask(payload, ctx)`` in place (momentum factor masking); returns
        ``tensor``. With ``sends_all`` it is zeroed; sparsifiers zero their indices."""
        if self.sends_all:
            return tensor.zero_()
        return tensor.masked_fill_(self.sent_mask(payload, ctx).view(tensor.shape), 0)

    @property
    def workspace(self) -> Workspace:
        """This compressor's scratch buffers (:class:`~grace_dgc.workspace.Workspace`),
        created on first use; temporaries of one call, never part of a payload."""
        workspace = self.__dict__.get("_workspace")
        if workspace is None:
            workspace = self.__dict__["_workspace"] = Workspace()
        return workspace

    def bind(self, engine: Engine) -> None:
        """Called by Grace with its engine (when built, or at the first exchange with
        ``engine="auto"``): keep what the method needs, e.g. the world size (fp16's
        pre-division) or the rank (the stochastic methods' streams). Default: nothing."""

    def preround(self, tensors: Sequence[Tensor], names: Sequence[str], engine: Engine) -> None:
        """With ``prerounds = True``: called by Grace with a fusion group's compensated tensors
        right before they are compressed, on every rank, to agree with the other ranks through
        ``engine`` on what :meth:`compress` needs (THC: the largest magnitude over ranks, so
        that all ranks quantize on one scale and their codes can be summed). Its bytes count
        as communication. Default: nothing."""


class Memory(Part):
    """Error feedback state kept between steps, keyed by tensor name.

    ``update`` learns what was sent only through the compressor's public methods
    (``decompress``, ``subtract_sent_``, ``mask_sent_``; never the ctx's layout), so any
    memory works with any compressor. ``compensate`` may return its input or the memory's own
    buffer (updated in place); it never writes to its input. ``update`` runs after the
    aggregate is written, and reads what ``compensate`` returned: Grace never writes the
    aggregate over it (an output that shares memory with it goes through a temporary).

    ``identity = True`` declares that ``compensate`` returns its input and ``update`` does
    nothing (the ``none`` memory): Grace may then reduce payloads in place.
    ``error_feedback = True`` declares that what a compressor did not send is fed back into
    later gradients (residual, DGC's momentum correction, EF-SignSGD's).
    """

    registered_name: ClassVar[str]  # set by the registry's decorator

    identity = False
    error_feedback = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A plugin written for the earlier ``attach_optimizer(optimizer, grace, named_parameters)``
        is refused by name where it is defined (the ``grace`` argument was removed before 0.1.0)."""
        super().__init_subclass__(**kwargs)
        attach = cls.__dict__.get("attach_optimizer")
        if attach is not None and len(inspect.signature(attach).parameters) == 4:  # self, optimizer, grace, params
            raise GraceConfigError(
                f"{cls.__qualname__}.attach_optimizer(optimizer, grace, named_parameters): the grace argument was "
                "removed; define attach_optimizer(self, optimizer, named_parameters)"
            )

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        return tensor

    def update(self, tensor: Tensor, name: str, compressor: Compressor, payload: Payload, ctx: Any) -> None:
        pass

    def decode_average(self, average: Tensor, name: str) -> None:
        """Turn the average over ranks of what was sent into the gradient the optimizer gets, in
        place, after :meth:`update`. Default: nothing (the average is the gradient). EF21 adds
        the estimate every rank keeps alike: the ranks send compressed *changes* of it."""

    def bind(self, engine: Engine) -> None:
        """Called by Grace with its engine (see :meth:`Compressor.bind`); e.g. the momentum
        memory's clipping threshold scales with the world size."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer | None, named_parameters: dict[str, Tensor]) -> None:
        """Called (through :meth:`Grace.attach_optimizer`) by ``DistributedOptimizer``, the DDP
        hook and the schedules with the optimizer (or None) and ``{name: parameter}``: for
        memories that read parameters or take over the optimizer's momentum (``momentum``).
        A plugin written for the earlier ``(optimizer, grace, named_parameters)`` is refused
        by name (:class:`~grace_dgc.errors.GraceConfigError`)."""


class Cost(NamedTuple):
    """One exchange's terms in the α-β model (:mod:`grace_dgc.costmodel`): ``steps`` latency
    steps (α each) and ``wire`` bytes on a rank's busiest link direction (β each); and, where
    declared, the bytes the engine counts on one rank for it (``stats()``'s ``bytes_sent`` and
    ``bytes_received``, size headers aside), which a projection reports."""

    steps: float
    wire: float
    sent: float | None = None
    received: float | None = None


class Communicator(Part):
    """Moves payloads between ranks through an engine and aggregates them.

    The data path calls one method, :meth:`aggregate_into`: write the aggregate over ranks of
    each tensor's decompressed payload (the compressor's ``aggregate``: a sum, or a vote)
    into an output, and say what this rank's memory should count as sent. Grace divides by
    the world size afterwards, for averaging methods. Communicators that move whole payloads
    (allreduce, allgather, broadcast) derive from :class:`~grace_dgc.communicators.exchange.ExchangeCommunicator`, which
    provides it from GRACE's ``exchange``.
    """

    registered_name: ClassVar[str]  # set by the registry's decorator

    needs_summable = False  # refuse compressors whose payloads cannot be summed
    # carries several rounds per step and agreement before compressing (the whole-payload
    # exchanges: grace_dgc.communicators.exchange.ExchangeCommunicator)
    carries_rounds = False
    # every rank's aggregate holds any NaN/Inf a rank sent (a plain sum on the wire): Grace
    # may then leave a non-finite gradient to the exchange instead of exchanging flags first
    propagates_nonfinite = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def refuse(self, compressor: Compressor) -> str | None:
        """Why this communicator cannot carry ``compressor``'s payloads, or None."""
        return type(self).refusal(compressor)

    @classmethod
    def refusal(cls, compressor: Compressor) -> str | None:
        """:meth:`refuse` with the communicator's default parameters. Default: only summable
        payloads with ``needs_summable``; a single round unless the class carries rounds."""
        if cls.needs_summable and not compressor.summable:
            return "its payloads cannot be summed"
        if compressor.rounds > 1 and not cls.carries_rounds:
            return "it exchanges several rounds per step (allgather, broadcast and allreduce carry those)"
        if compressor.prerounds and not cls.carries_rounds:
            return "it agrees with every rank before compressing (allgather, broadcast and allreduce carry that)"
        return None

    @classmethod
    def fits(cls, compressor: Compressor) -> bool:
        return cls.refusal(compressor) is None

    @classmethod
    def cost(cls, nodes: int, nbytes: float, dense_bytes: float, **settings: Any) -> Cost | None:
        """This communicator's α-β terms for one exchange on ``nodes`` ≥ 2 ranks of ``nbytes``
        per rank (``dense_bytes``: the same gradients in fp32), with these ``settings`` of its
        own; None: no model declared. What ``auto`` (which tries a plugin communicator that
        declares one among its candidates), ``grace-dgc project`` and :mod:`grace_dgc.costmodel`
        read."""
        return None

    def setup(self) -> Engine:
        """Called by Grace when it binds, on every rank (it may run collectives: ``hierarchical``
        forms its groups here, except on an engine without them, ``engine.collectives``
        False); returns the engine the compressor and memory bind to."""
        return self.engine

    def wire_compressor(self, compressor: Compressor) -> Compressor:
        """The compressor Grace runs on each gradient (``reduce_scatter`` compresses chunk by
        chunk); called by Grace when it binds, after :meth:`setup`."""
        return compressor

    def prereduce(self, tensors: list[Tensor], names: list[str]) -> list[Tensor]:
        """Tensors to compress in place of the gradients (``hierarchical``: their sum over
        the node; ``auto``: with a carried error folded in), never written in place.
        Default: the gradients themselves."""
        return tensors

    def plan(self, names: list[str], adopt: Tensor | None = None) -> Tensor | None:
        """What this communicator decided for ``names`` that ranks compressing alike but not
        exchanging (a node's other ranks under ``hierarchical``) must share, as a tensor of
        the same size on every rank (``auto``: its choices); with ``adopt``, the exchanging
        rank's plan, to follow from now on. None: it decides nothing."""
        return None

    def aggregate_into(
        self, comp: Compressor, payloads: Payloads, ctxs: Ctxs, names: list[str], outs: Tensors, consume: bool = False
    ) -> Sent:
        """Write Σ over ranks of each decompressed payload (the compressor's ``aggregate``,
        before Grace divides by the world size) into ``outputs``; return, per tensor, the
        payload and ctx this rank's memory should count as sent (its own; the part of it the
        aggregate kept, gTop-k; its last round's, PowerSGD). ``consume=True``: nothing reads
        the payloads afterwards, so they may be reduced where they lie."""
        raise NotImplementedError


def audit_declarations(parts: Sequence[tuple[str, Part]]) -> None:
    """Warn of what a part keeps across steps without declaring it (after the first exchange,
    where the parts' state exists): checkpoints, reset() and skipped steps would miss it."""
    for kind, part in parts:
        undeclared = part.undeclared_state()
        if undeclared:
            warnings.warn(
                f"{kind} {getattr(part, 'registered_name', type(part).__name__)} keeps {', '.join(undeclared)} "
                "across steps but declares it neither STATE nor RANK_LOCAL: checkpoints, reset() and skipped "
                "steps miss it. Name it in STATE (or RANK_LOCAL, with why), or override state_dict and reset",
                stacklevel=3,
            )
