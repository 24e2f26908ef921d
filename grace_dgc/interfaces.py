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

from .workspace import Workspace

if TYPE_CHECKING:
    from .engines.base import Engine
    from .grace import Grace

Payload = list[Tensor]  # the tensors one compressor puts on the wire for one gradient


class Compressor:
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
    """

    registered_name: ClassVar[str]  # set by the registry's decorator

    summable = False
    average = True
    rounds = 1
    elementwise = False
    sparse = False  # the payload is [values, int32 flat indices] and decompress scatters them
    chunkable = True  # compressing a tensor chunk by chunk is still this method (not top-k)

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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Memory:
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

    def reset(self, name: str | None = None) -> None:
        """Forget what was kept, for every tensor or only ``name``'s (deliberately, e.g.
        after changing the model); the next step starts from zero state."""

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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Communicator:
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

    def prereduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Tensors to compress in place of the gradients (``hierarchical``: their sum over
        the node). Default: the gradients themselves."""
        return tensors

    def aggregate_many(
        self, compressor: Compressor, payloads: list[Payload], ctxs: list[Any], names: list[str], outs: list[Tensor]
    ) -> list[Payload]:
        """For ``aggregates = True``: write Σ over ranks of each decompressed payload (the
        compressor's ``aggregate``, before Grace divides by the world size) into ``outs``, and
        return, per tensor, the payload this rank's memory should count as sent (its own, or
        the part of it the aggregate kept)."""
        raise NotImplementedError

    def reset(self, name: str | None = None) -> None:
        """Forget state kept for ``name`` (or all): e.g. ``reduce_scatter``'s owner-side errors."""

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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

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
