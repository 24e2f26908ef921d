"""``DistributedOptimizer``: wraps any torch optimizer so gradients are exchanged through
a :class:`~grace_dgc.grace.Grace` as soon as backward produces them.

It is a plain wrapper (no dynamically built subclass): it shares the wrapped optimizer's
``param_groups`` and ``state`` objects, so LR schedulers and ``zero_grad`` act on it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch

from ..engines import create_engine
from ..engines.base import Engine
from ..errors import GraceConfigError, StepDiscarded, check_bool, on_every_rank
from .driver import FUSION_BYTES, Driver

if TYPE_CHECKING:
    from ..grace import Grace


_DDPS: weakref.WeakSet[Any] = weakref.WeakSet()  # every live DistributedDataParallel (see _note_a_ddp)


def _note_a_ddp(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    """A global module-registration hook: DDP registers the model it wraps as ``module``. It runs
    when a submodule is assigned (model building), never in forward, and lets a wrapper find the
    DDPs of its parameters in microseconds (scanning the heap took seconds per wrapper)."""
    if name == "module" and isinstance(module, torch.nn.parallel.DistributedDataParallel):
        _DDPS.add(module)


torch.nn.modules.module.register_module_module_registration_hook(_note_a_ddp)


class WrappingOptimizer(Driver, torch.optim.Optimizer):
    """A way in that wraps a user's optimizer (``DistributedOptimizer``, the schedules) and
    shares it: its ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's
    (LR schedulers act on it); it is not picklable (it holds a live Grace: save
    ``state_dict()``)."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise GraceConfigError("add parameter groups to the wrapped optimizer before wrapping it")

    def __getstate__(self) -> Any:
        raise TypeError(f"{type(self).__name__} is not picklable; save state_dict() instead")

    def _refuse_a_ddp_wrap(self) -> None:
        """Once, at the first step: refuse parameters that a live ``DistributedDataParallel``
        also wraps. DDP's own full allreduce then runs in every backward beside grace's
        exchanges: dense traffic flows while the stats count grace's bytes only, and the
        method's result is not what it measures (a small GPT under 0/1 Adam: 10.4x fewer
        bytes reported, the loss 3.60 against 3.08). DDP may be wrapped after this wrapper was
        built (nanoGPT builds its optimizer first), hence the look at the first step (once), over
        the DDPs made since grace_dgc was imported (:func:`_note_a_ddp`)."""
        if getattr(self, "_ddp_checked", False):
            return
        self._ddp_checked = True
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        wrapped = any(id(p) in mine for ddp in list(_DDPS) for p in ddp.module.parameters())
        if wrapped:
            raise GraceConfigError(
                f"{type(self).__name__}: the model's parameters are also wrapped in torch's "
                "DistributedDataParallel, whose own allreduce of every gradient runs beside grace's exchanges "
                "(dense traffic that grace's stats do not count, and gradients averaged twice). Train the bare "
                "model: drop the DDP wrap and call grace_dgc.broadcast_parameters(model.state_dict(), "
                "root_rank=0) once instead (docs/engines.md 'A schedule in a DDP script'); for DDP itself use "
                "grace_dgc.ddp_comm_hook"
            )


class DistributedOptimizer(WrappingOptimizer):
    """Horovod-style distributed optimizer over a ``Grace``.

    1. Parameters are grouped into fusion buckets of up to ``fusion_bytes`` of gradient,
       in reverse registration order (the order backward tends to produce them), as DDP
       does; ``fusion_bytes=0`` gives every parameter its own exchange. A bucket holds one
       dtype on one device, and the gradients of a bucket of several parameters live in one
       flat buffer: ``p.grad`` is a view into it (as DDP's ``gradient_as_bucket_view``).
    2. A post-accumulate-grad hook on each parameter counts backward passes; once every
       parameter of a bucket has had its ``backward_passes_per_step``-th, the gradients not
       yet in their views are moved there (after ``zero_grad(set_to_none=True)`` autograd
       makes new tensors: one batched copy per bucket, as DDP's ``batched_grad_copy``) and the
       bucket goes to
       ``grace.step_group_async(..., inplace=True)``: each gradient is compressed on its own
       (an elementwise compressor with no memory compresses the flat buffer at once), the
       payloads travel together, and the averages are written back into the buffer
       (compression and collectives run on grace's communication thread, overlapping the
       rest of backward). Gradients of several passes are summed, as in Horovod.
    3. Buckets go out strictly in bucket order, so ranks issue matching collectives even
       when a parameter gets no gradient on some rank only (an unused branch): that bucket
       waits for ``synchronize()``, which submits the buckets no hook completed (in bucket
       order, with zero gradients where ``grad`` is None) and waits: the averages are then
       in ``p.grad``.
    4. ``step()`` synchronizes unless ``synchronize()`` was already called for this step
       (e.g. to clip the averaged gradients first), then steps the wrapped optimizer —
       unless a gradient was NaN/Inf on some rank (``found_inf``): then every rank skips the
       step alike, and the gradients of the skipped groups are NaN, so that
       ``torch.amp.GradScaler`` finds them too::

           scaler.scale(loss).backward()
           optimizer.synchronize()
           scaler.unscale_(optimizer)            # finds the NaN: found_inf on every rank
           with optimizer.skip_synchronize():
               scaler.step(optimizer)            # skipped alike on every rank
           scaler.update()

    Every rank must produce gradients for the same parameters in the same order (true
    for identical models); the engine's collectives match by order. As in Horovod and DDP,
    a gradient is exchanged in place as soon as its bucket is ready: read ``p.grad`` after
    ``synchronize()`` (or ``step()``), not between ``backward()`` and it.
    """

    SETTINGS = ("backward_passes_per_step", "fusion_bytes")
    RESUME_MAY_DIFFER = {
        "fusion_bytes": "fusion only batches the exchange; what is kept is kept per parameter name",
        "backward_passes_per_step": "accumulation only sums more passes into the gradient an exchange sends",
    }
    OBJECTS = ("optimizer",)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        backward_passes_per_step: int = 1,
        fusion_bytes: int = FUSION_BYTES,
    ) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns groups and state.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise GraceConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise GraceConfigError(f"backward_passes_per_step={backward_passes_per_step!r}; accepted: an int >= 1")
        if isinstance(fusion_bytes, bool) or not isinstance(fusion_bytes, int) or fusion_bytes < 0:
            raise GraceConfigError(f"fusion_bytes={fusion_bytes!r}; accepted: an int >= 0 (0: no fusion)")
        self.optimizer = optimizer
        self.grace = grace
        self.backward_passes_per_step = backward_passes_per_step
        self.fusion_bytes = fusion_bytes
        self._names = self._name_parameters(optimizer, named_parameters)
        self._buckets = self._make_buckets(list(self._names), fusion_bytes)
        # keyed by id(): a tensor's __hash__ is a Python call, and these are looked up once per
        # parameter per backward pass on the training thread
        self._bucket_of = {id(p): i for i, bucket in enumerate(self._buckets) for p in bucket}
        self._bucket_names = [[self._names[p] for p in bucket] for bucket in self._buckets]
        # per bucket of several parameters: its flat gradient buffer and the parameters' views
        # into it (None for a lone parameter, whose gradient stays where autograd put it)
        self._flats, self._views = self._bucket_views(self._buckets)
        self._passes: dict[int, int] = {}  # id(param) -> backward passes since the last exchange
        self._final: set[int] = set()  # id() of the parameters whose gradients are final this step
        self._finals = [0] * len(self._buckets)  # per bucket: how many of its gradients are final
        self._pending: dict[int, Future] = {}  # bucket index -> Future of its averaged gradients
        self._synchronized = False  # averaged gradients are in p.grad, awaiting step()
        self._skipped_mark = grace.skipped
        self.found_inf = False  # this step had a NaN/Inf gradient on some rank: step() skips it
        self._joining: _Join | None = None  # inside join(): see there
        # before any hook is registered: a memory that refuses this optimizer leaves nothing behind
        self._attach_memory()
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self._on_grad_ready)) for p in self._names]
        self._claim(grace)
        self._plan(grace, self._buckets)  # ranks compare every bucket at the first exchange, not as they come
        grace.watch({name: p for p, name in self._names.items()}, optimizer)

    @classmethod
    def _make_buckets(cls, params: list[torch.nn.Parameter], fusion_bytes: int) -> list[list[torch.nn.Parameter]]:
        return cls._fusion_groups(list(reversed(params)), fusion_bytes)  # reverse order, as DDP

    @staticmethod
    def _bucket_views(
        buckets: list[list[torch.nn.Parameter]],
    ) -> tuple[list[torch.Tensor | None], list[list[torch.Tensor] | None]]:
        """Per bucket of several parameters, a flat buffer (zeros) and each parameter's
        gradient view into it; None for a lone parameter, whose own gradient is already flat."""
        flats: list[torch.Tensor | None] = []
        views: list[list[torch.Tensor] | None] = []
        for bucket in buckets:
            if len(bucket) == 1:
                flats.append(None)
                views.append(None)
                continue
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            flats.append(flat)
            views.append([view.view_as(p) for p, view in zip(bucket, flat.split([p.numel() for p in bucket]))])
        return flats, views

    def _gradients(self, bucket: int) -> list[torch.Tensor]:
        """Make every ``param.grad`` of ``bucket`` its view into the bucket's buffer (zeros
        where there is no gradient) and return them. After ``zero_grad(set_to_none=True)``
        autograd made new tensors: they are copied in by one ``_foreach_copy_`` for the bucket
        (as DDP's ``batched_grad_copy``), not one copy per parameter as each gradient arrives."""
        params, views = self._buckets[bucket], self._views[bucket]
        if views is None:  # a bucket of its own: the gradient stays where autograd put it
            (param,) = params
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif not param.grad.is_contiguous():
                param.grad = param.grad.contiguous()
            return [param.grad]
        sources, targets = [], []
        for param, view in zip(params, views):
            grad = param.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                sources.append(grad)
                targets.append(view)
            param.grad = view
        if sources:
            torch._foreach_copy_(targets, sources)
        return views

    def _attach_memory(self) -> None:
        # e.g. the momentum memory takes over SGD's momentum
        self.grace.attach_optimizer(self.optimizer, {n: p for p, n in self._names.items()})

    # -- the exchange ------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self._synchronized:
            raise RuntimeError(
                "backward() ran between synchronize() and step(); call step() "
                "(or zero_grad()) before the next backward pass"
            )
        key = id(param)
        bucket = self._bucket_of[key]
        if key in self._final or bucket in self._pending:
            raise RuntimeError(
                f"gradient of {self._names[param]!r} was computed again before step()/synchronize(); "
                f"use backward_passes_per_step={self.backward_passes_per_step + 1} to accumulate passes"
            )
        if self.backward_passes_per_step > 1:
            count = self._passes.get(key, 0) + 1
            self._passes[key] = count
            if count < self.backward_passes_per_step:
                return
        self._final.add(key)
        self._finals[bucket] += 1
        # only a bucket completed next in line can let buckets go (they go out in order)
        if self._finals[bucket] == len(self._buckets[bucket]) and bucket == len(self._pending):
            self._submit_in_order()

    def _submit_in_order(self) -> None:
        """Submit the complete buckets whose predecessors are all submitted: every rank issues
        its exchanges in bucket order, even when a parameter gets no gradient on some rank
        only (that bucket, and the ones after it, then wait for ``synchronize()``, which
        exchanges zeros for it)."""
        while len(self._pending) < len(self._buckets):
            bucket = len(self._pending)  # buckets go out as 0, 1, 2, ...
            if self._finals[bucket] < len(self._buckets[bucket]):
                break
            self._submit(bucket)

    def _submit(self, bucket: int) -> None:
        joining = self._joining
        if bucket == 0 and joining is not None and not joining.shadowing:  # a step begins: "still here"
            joining.active = self.grace.run_in_order(lambda: self._count_active(still_here=True))
        # a parameter unused this step (on every rank) exchanges zeros
        self._pending[bucket] = self.grace.step_group_async(
            self._gradients(bucket),
            self._bucket_names[bucket],
            inplace=True,
            span=self._flats[bucket],
            overlap=bucket < len(self._buckets) - 1,  # the last one: backward is over, nothing to overlap
        )

    def synchronize(self) -> None:
        """Wait for every parameter's exchange and write the averaged gradients."""
        self._refuse_a_ddp_wrap()
        for bucket in range(len(self._buckets)):
            if bucket not in self._pending:
                self._submit(bucket)
        started = time.perf_counter()
        try:
            for bucket, future in self._pending.items():
                for param, average in zip(self._buckets[bucket], future.result()):
                    grad = cast(torch.Tensor, param.grad)  # _submit gave every parameter one
                    if average is not grad and average.data_ptr() != grad.data_ptr():  # in place: already there
                        grad.copy_(average)
        except StepDiscarded:  # a fault-tolerant job lost a group: step() will not commit, wait for the rest
            wait(list(self._pending.values()))
            errors = [f.exception() for f in self._pending.values() if f.exception() is not None]
            other = next((e for e in errors if not isinstance(e, StepDiscarded)), None)
            if other is not None:  # a mistake met on every rank is named, not taken for a lost group
                raise other from None
        self.grace.add_wait(time.perf_counter() - started)
        self._pending.clear()
        self._clear_counts()
        self._synchronized = True
        joining = self._joining
        if joining is not None and not joining.shadowing:
            joining.steps += 1
            size = self.grace.engine.size
            active = size if joining.active is None else joining.active.result()
            if joining.divide_by_active and active < size:  # the average of the ranks still training
                for param in self._names:
                    cast(torch.Tensor, param.grad).mul_(size / active)
        # a group skipped for a non-finite gradient (the same decision on every rank)
        self.found_inf = self.grace.skipped != self._skipped_mark
        self._skipped_mark = self.grace.skipped

    @contextmanager
    def join(self, divide_by_active: bool = False, module: torch.nn.Module | None = None) -> Iterator[None]:
        """Uneven inputs: inside this block ranks may run different numbers of steps.

        As DDP's ``Join``: at the start of each step (its first bucket) every rank still
        training says so in one small allreduce, on grace's communication thread, in order
        with the exchanges. A rank whose loop has ended leaves the block and *shadows* the
        others: it answers "joined" and exchanges zero gradients through the same buckets
        and methods (so every collective still has all ranks), until no rank is training.
        Then the parameters of the rank that ran the most steps (the lowest such rank) are
        broadcast to all, and with ``module`` its buffers too (BatchNorm statistics), so the
        ranks leave the block with the same model.

        The average is over all ranks (a joined rank adds zeros), as DDP's default
        ``divide_by_initial_world_size=True``; ``divide_by_active=True`` divides by the
        ranks still training instead. A joined rank's memory keeps running on zeros (its
        error feedback still drains) and its optimizer state stays its own, as in DDP.
        Exceptions inside the block propagate without shadowing."""
        if self._joining is not None:
            raise GraceConfigError("join() is already active on this optimizer")
        check_bool("divide_by_active", divide_by_active)
        if self._pending or self._synchronized:
            raise RuntimeError("enter join() between steps: call step() (or zero_grad()) first")
        self._joining = _Join(divide_by_active)
        try:
            yield
            if self._pending or self._synchronized:
                raise RuntimeError("the join() block ended in the middle of a step: call step() before leaving it")
            self._shadow_until_all_joined(module)
        finally:
            self._joining = None

    def _count_active(self, still_here: bool) -> int:
        """The ranks still training; the same message carries each rank's ``divide_by_active``
        so that ranks averaging differently are an error on every rank, not diverging models."""
        engine, dividing = self.grace.engine, cast(_Join, self._joining).divide_by_active
        flags = torch.tensor([float(still_here), float(dividing)], device=next(iter(self._names)).device)
        active, divide = (int(v) for v in engine.allreduce(flags).tolist())
        if divide not in (0, engine.size):
            raise on_every_rank(
                GraceConfigError(
                    f"join(divide_by_active=...) differs between ranks ({divide} of {engine.size} ranks passed "
                    "True): every rank must average the same way"
                )
            )
        return active

    def _shadow_until_all_joined(self, module: torch.nn.Module | None) -> None:
        joining = cast(_Join, self._joining)
        joining.shadowing = True
        while self.grace.run_in_order(lambda: self._count_active(still_here=False)).result():
            for param in self._names:  # this rank's contribution: zeros, through the same buckets
                param.grad = None
            for bucket in range(len(self._buckets)):
                self._submit(bucket)
            for future in self._pending.values():
                future.result()
            self._pending.clear()
        tensors = [p.data for p in self._names]
        if module is not None:
            tensors += [b for b in module.buffers() if b.dtype != torch.bool]
        self.grace.run_in_order(lambda: self._sync_from_longest(joining.steps, tensors)).result()

    def _sync_from_longest(self, steps: int, tensors: list[torch.Tensor]) -> None:
        engine = self.grace.engine
        device = tensors[0].device if tensors else torch.device("cpu")
        counts = [int(c.item()) for c in engine.allgather(torch.tensor([steps], device=device))]
        broadcast_parameters(list(enumerate(tensors)), root_rank=counts.index(max(counts)), engine=engine)

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's idiom ``synchronize(); clip; with skip_synchronize(): step()`` (step()
        already skips a second exchange after synchronize(); this is for ported scripts)."""
        self._synchronized = True
        yield

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise GraceConfigError(
                "DistributedOptimizer.step does not take a closure (the closure's backward would need its own exchange)"
            )
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        if not self.coordinator.commit():  # torchft: this group met a lost one: it discards the step
            self.optimizer.zero_grad()
            return None
        if self.found_inf:  # every rank skips this step alike (grace's nonfinite="skip")
            return None
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise RuntimeError(
                "zero_grad() called while gradient exchanges are in flight; call step() or synchronize() first"
            )
        self._clear_counts()
        self._synchronized = False
        self.coordinator.begin()  # torchft: the quorum forms, a group that rejoins takes its peer's state
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def _clear_counts(self) -> None:
        self._passes.clear()
        self._final.clear()
        self._finals = [0] * len(self._buckets)

    def _load_foreign(self, state: Any) -> bool:
        """A plain optimizer checkpoint (``optimizer.state_dict()`` of the wrapped optimizer)."""
        if not isinstance(state, dict) or "grace" in state or "state" not in state or "param_groups" not in state:
            return False
        self._refuse_other_shapes({"optimizer": state})
        self.optimizer.load_state_dict(state)
        self._attach_memory()  # its momentum must move into the memory again, not apply twice
        return True

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, {self.grace!r})"


def _weak_hook(method: Callable[[torch.nn.Parameter], None]) -> Callable[[torch.nn.Parameter], None]:
    """``method`` as a parameter's hook that does not keep its object alive. autograd holds a
    tensor's hooks where the garbage collector cannot see, so a hook bound to the wrapper made a
    cycle (parameter -> hook -> wrapper -> optimizer -> parameter) that was never freed: every
    wrapper a process dropped kept its model, its Grace and the Grace's process groups (gloo's
    threads), and its hooks went on firing. A dropped wrapper's hooks do nothing."""
    owner, function = weakref.ref(method.__self__), method.__func__  # type: ignore[attr-defined]

    def hook(param: torch.nn.Parameter) -> None:
        obj = owner()
        if obj is not None:
            function(obj, param)

    return hook


class _Join:
    """State of :meth:`DistributedOptimizer.join`: the step's "still training" count (a
    Future), the steps this rank ran, and whether it now shadows the others."""

    def __init__(self, divide_by_active: bool) -> None:
        self.divide_by_active = divide_by_active
        self.active: Future[int] | None = None
        self.steps = 0
        self.shadowing = False


def broadcast_parameters(params: Any, root_rank: int = 0, engine: str | Engine = "auto") -> None:
    """Copy parameters/buffers from ``root_rank`` to every rank, in place.

    ``params``: a ``state_dict()`` or an iterable of ``(name, tensor)`` pairs.
    """
    eng = create_engine(engine)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    with torch.no_grad():
        for _, tensor in items:
            if not torch.is_tensor(tensor):
                raise GraceConfigError(f"broadcast_parameters needs tensors, got {type(tensor).__name__}")
            buffer = tensor.data.contiguous()
            eng.broadcast(buffer, root_rank)
            if buffer.data_ptr() != tensor.data.data_ptr():
                tensor.data.copy_(buffer)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, engine: str | Engine = "auto"
) -> None:
    """Make every rank's optimizer state (and grace state) equal to ``root_rank``'s."""
    eng = create_engine(engine)
    state = eng.broadcast_object(optimizer.state_dict(), root_rank)
    if eng.rank != root_rank:
        optimizer.load_state_dict(state)
