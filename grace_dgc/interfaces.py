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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from .errors import GraceConfigError
from .workspace import Workspace

if TYPE_CHECKING:
    from .engines.base import Engine
    from .grace import Grace

Payload = list[Tensor]  # the tensors one compressor puts on the wire for one gradient


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

    ``tests/test_declarations.py`` walks every registered part and fails on a constructor
    parameter or a tensor kept across steps that none of these names.
    """

    SETTINGS: ClassVar[tuple[str, ...]] = ()
    STATE: ClassVar[tuple[str, ...]] = ()
    RANK_LOCAL: ClassVar[dict[str, str]] = {}
    RESUME_MAY_DIFFER: ClassVar[dict[str, str]] = {}

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

    def snapshot(self, names: Sequence[str]) -> dict[str, Any]:
        """Copies of the state kept for ``names`` (and of the state kept for no tensor):
        Grace takes one before a step that may still be skipped after the state changed."""
        return {key: _snapshot(getattr(self, key), names) for key in self.STATE}

    def restore(self, snapshot: dict[str, Any], names: Sequence[str]) -> None:
        """Put back what :meth:`snapshot` copied: ``names``' state is bitwise as it was."""
        for key, saved in snapshot.items():
            setattr(self, key, _restored(getattr(self, key), saved, names))


def _name(part: Any) -> str:
    return getattr(type(part), "registered_name", type(part).__name__)


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

    Class attributes:
      summable: two ranks' payloads may be summed elementwise (only then is allreduce valid).
      average:  divide the aggregate by the world size (False for majority vote).
      elementwise: compress and decompress act element by element with a ctx that depends on
                the dtype only (none, fp16, bf16), so Grace may compress a fusion bucket's flat
                buffer as one tensor instead of its tensors one by one.
      sparse:   the payload is ``[values, indices]`` (int32 indices into the flattened tensor,
                each at most once) and ``decompress`` scatters the values into zeros, so
                payloads can be summed index by index (``sparse_allreduce``).
      chunkable: compressing the chunks of a tensor one by one is still the method (true of
                quantizers, false of top-k selections): ``reduce_scatter`` needs it.
      rounds:   the most exchanges per tensor. With rounds > 1 (PowerSGD) Grace calls
                ``next_round`` with each round's payload summed over ranks, the last round
                included; it returns the next payload, or None once the tensor is done.
                Such payloads must be summable (with any communicator).
      may_overflow: a finite input may come out of the exchange as Inf (fp16's ±65504):
                Grace then copies the state a step changes, so a skipped step restores it.
    """

    registered_name: ClassVar[str]  # set by the registry's decorator
    RANK_LOCAL: ClassVar[dict[str, str]] = {
        "_workspace": "scratch buffers of one call, never part of a payload or of the state"
    }

    summable = False
    average = True
    rounds = 1
    elementwise = False
    sparse = False  # the payload is [values, int32 flat indices] and decompress scatters them
    chunkable = True  # compressing a tensor chunk by chunk is still this method (not top-k)
    may_overflow = False  # a finite input can overflow the wire format (fp16)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        raise NotImplementedError

    def next_round(self, summed_payload: Payload, ctx: Any) -> tuple[Payload, Any]:
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

    def mask_sent_(self, tensor: Tensor, payload: Payload, ctx: Any) -> Tensor:
        """``tensor ⊙ ¬sent_mask(payload, ctx)`` in place (momentum factor masking); returns
        ``tensor``. Methods that send every element zero it; sparsifiers zero their indices."""
        return tensor.masked_fill_(self.sent_mask(payload, ctx).view(tensor.shape), 0)

    @property
    def workspace(self) -> Workspace:
        """This compressor's scratch buffers (:class:`~grace_dgc.workspace.Workspace`),
        created on first use; temporaries of one call, never part of a payload."""
        workspace = self.__dict__.get("_workspace")
        if workspace is None:
            workspace = self.__dict__["_workspace"] = Workspace()
        return workspace

    def aggregate(self, tensors: Sequence[Tensor]) -> Tensor:
        """Combine the decompressed tensors of all ranks (default: their sum)."""
        return torch.stack(list(tensors)).sum(dim=0) if len(tensors) > 1 else tensors[0]

    def sent_mask(self, payload: Payload, ctx: Any) -> Tensor:
        """Bool tensor shaped like the gradient: True where this rank's own payload carried
        the element (used by memories such as ``momentum`` for momentum factor masking).

        Default: ``decompress(payload, ctx) != 0``, so a sent exact zero reads as not sent;
        sparsifiers (topk, threshold, dgc) override it with their exact index set, and a
        method that sends every element should return all True.
        """
        return self.decompress(payload, ctx) != 0

    # -- optional hooks: no-ops unless a method needs them ------------------------------
    def bind(self, engine: Engine) -> None:
        """Called by Grace with its engine (when built, or at the first exchange with
        ``engine="auto"``): keep what the method needs, e.g. the world size (fp16's
        pre-division) or the rank (the stochastic methods' streams)."""

    def set_epoch(self, epoch: int) -> None:
        """The current epoch, from ``Grace.set_epoch`` (e.g. DGC's warm-up)."""

    def stats(self) -> dict[str, Any]:
        """Method-specific figures merged into ``Grace.stats()`` (e.g. DGC's current ratio)."""
        return {}


class Memory(Part):
    """Error feedback state kept between steps, keyed by tensor name.

    ``update`` learns what was sent only through the compressor's public methods
    (``decompress``, ``subtract_sent_``, ``sent_mask``; never the ctx's layout), so any
    memory works with any compressor. ``compensate`` may return the memory's own buffer
    (updated in place); it never writes to its input.

    ``identity = True`` declares that ``compensate`` returns its input and ``update`` does
    nothing (the ``none`` memory): Grace may then reduce payloads in place.
    """

    registered_name: ClassVar[str]  # set by the registry's decorator

    identity = False

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        return tensor

    def update(self, tensor: Tensor, name: str, compressor: Compressor, payload: Payload, ctx: Any) -> None:
        pass

    # -- optional hooks: no-ops unless a method needs them ------------------------------
    def bind(self, engine: Engine) -> None:
        """Called by Grace with its engine (see :meth:`Compressor.bind`); e.g. the momentum
        memory's clipping threshold scales with the world size."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, grace: Grace, named_parameters: Any) -> None:
        """Called by ``DistributedOptimizer`` and the DDP hook with the optimizer (or None)
        and ``{name: parameter}``: for memories that read parameters or take over the
        optimizer's momentum (``momentum``)."""

    def set_epoch(self, epoch: int) -> None:
        """The current epoch, from ``Grace.set_epoch``."""

    def stats(self) -> dict[str, Any]:
        """Method-specific figures merged into ``Grace.stats()``."""
        return {}


class Communicator(Part):
    """Moves payloads between ranks through an engine.

    ``exchange(payload, name)`` returns a list of payloads: every rank's (allgather,
    broadcast) or a single summed one when ``reduces`` is True (allreduce).
    ``exchange_many`` moves several tensors' payloads in one exchange (a fusion group).
    """

    registered_name: ClassVar[str]  # set by the registry's decorator

    reduces = False
    needs_summable = False
    reduces_in_place = False  # exchange_many accepts consume=True (see Allreduce)
    aggregates = False  # the collective itself aggregates: Grace calls aggregate_many instead

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def refuse(self, compressor: Compressor) -> str | None:
        """Why this communicator cannot carry ``compressor``'s payloads, or None."""
        return type(self).refusal(compressor)

    @classmethod
    def refusal(cls, compressor: Compressor) -> str | None:
        """:meth:`refuse` with the communicator's default parameters."""
        if cls.needs_summable and not compressor.summable:
            return "its payloads cannot be summed"
        if cls.aggregates and compressor.rounds > 1:
            return "it exchanges several rounds per step (allgather, broadcast and allreduce carry those)"
        return None

    @classmethod
    def fits(cls, compressor: Compressor) -> bool:
        return cls.refusal(compressor) is None

    def wire_compressor(self, compressor: Compressor) -> Compressor:
        """The compressor Grace runs on each gradient (``reduce_scatter`` compresses chunk by
        chunk); called by Grace when it binds."""
        return compressor

    def setup(self) -> Engine:
        """Called by Grace when it binds, on every rank (it may run collectives: ``hierarchical``
        forms its groups here); returns the engine the compressor and memory bind to."""
        return self.engine

    def prereduce(self, tensors: list[Tensor], names: list[str]) -> list[Tensor]:
        """Tensors to compress in place of the gradients (``hierarchical``: their sum over
        the node; ``auto``: with a carried error folded in), never written in place.
        Default: the gradients themselves."""
        return tensors

    def aggregate_many(
        self, compressor: Compressor, payloads: list[Payload], ctxs: list[Any], names: list[str], outs: list[Tensor]
    ) -> list[Payload]:
        """For ``aggregates = True``: write Σ over ranks of each decompressed payload (the
        compressor's ``aggregate``, before Grace divides by the world size) into ``outs``, and
        return, per tensor, the payload this rank's memory should count as sent (its own, or
        the part of it the aggregate kept)."""
        raise NotImplementedError

    def aggregate_into(
        self, compressor: Compressor, payloads: list[Payload], ctxs: list[Any], names: list[str], outs: list[Tensor]
    ) -> list[Payload]:
        """:meth:`aggregate_many` for any single-round communicator: an aggregating one does it
        itself; the others exchange, then decompress the sum (or each rank's payload) into
        ``outs``. Used where one communicator runs inside another (``hierarchical``, ``auto``)."""
        if self.aggregates:
            return self.aggregate_many(compressor, payloads, ctxs, names, outs)
        for out, got, ctx in zip(outs, self.exchange_many(payloads, names), ctxs):
            if self.reduces:
                compressor.decompress_into(got[0], ctx, out)
            else:
                compressor.decompress_aggregate_into(got, ctx, out)
        return payloads

    def stats(self) -> dict[str, Any]:
        """Communicator-specific figures merged into ``Grace.stats()`` (``auto``'s choices)."""
        return {}

    def set_epoch(self, epoch: int) -> None:
        """The current epoch, from ``Grace.set_epoch`` (no built-in communicator needs it)."""

    def exchange(self, payload: Payload, name: str) -> list[Payload]:
        raise NotImplementedError

    def exchange_many(self, payloads: list[Payload], names: list[str]) -> list[list[Payload]]:
        """Exchange several payloads at once: they travel as one payload (their tensors
        concatenated into one list), so one size exchange and one data collective serve the
        whole group. Returns, per payload, what :meth:`exchange` would have returned."""
        if len(payloads) == 1:
            return [self.exchange(payloads[0], names[0])]
        gathered = self.exchange([t for payload in payloads for t in payload], ",".join(names))
        out, start = [], 0
        for payload in payloads:
            out.append([tensors[start : start + len(payload)] for tensors in gathered])
            start += len(payload)
        return out
