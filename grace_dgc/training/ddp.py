"""Gradient compression inside ``DistributedDataParallel`` through its communication hook.

    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.01)
    ddp_model = DistributedDataParallel(model)
    state, hook = grace_dgc.ddp_comm_hook(grace, ddp_model)
    ddp_model.register_comm_hook(state, hook)

DDP hands the hook one bucket at a time: a flat buffer holding several parameters' local
(un-averaged) gradients. The hook hands the bucket to ``grace.step_group_async``: each
parameter's gradient is compressed separately under the parameter's name and the payloads
travel together (one fused exchange per bucket), so compression and error-feedback memory
are per parameter, exactly as with :class:`~grace_dgc.DistributedOptimizer`, and do not
depend on how DDP groups parameters into buckets (it regroups them after the first
iteration). Grace averages over ranks, which is the division DDP's built-in allreduce does.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, NoReturn

import torch
from torch import Tensor

from ..errors import GraceConfigError
from ..workspace import flat_span
from .driver import Driver

if TYPE_CHECKING:
    from concurrent.futures import Future

    from torch.distributed import GradBucket

    from ..grace import Grace


#: how a hook user restores grace's state, named by the warning of a resume that forgot it
RESUME = (
    "restore the DDP hook's state: every rank saves its own state.state_dict() (state, hook = "
    "grace_dgc.ddp_comm_hook(...)) beside the model and the optimizer, and on resume calls "
    "state.load_state_dict() with it before the first step; or, into rank 0's file, "
    "grace_dgc.gather_state(state), restored with grace_dgc.load_gathered_state(state, ...)"
)


class GraceHookState(Driver):
    """What the hook needs: the :class:`~grace_dgc.Grace` and each parameter's name.

    Names come from the model's ``named_parameters()`` (DDP's ``module.`` prefix removed,
    so they match ``DistributedOptimizer(opt, grace, model.named_parameters())``). Without
    a model, parameters are named ``param.<k>`` in the order the hook first sees them,
    which is DDP's initial bucket order: the same on every rank and in every run of the
    same model, so checkpoints still line up.

    ``state_dict()`` (grace's compressor and memory state, keyed by those names) is plain
    picklable data: save it with the model and optimizer, ``load_state_dict`` it on resume.
    """

    KIND = "hook"

    def __init__(
        self, grace: Grace, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        self.grace = grace
        self._names: dict[Tensor, str] = {}  # parameter -> name
        if model is not None:
            module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            if not isinstance(module, torch.nn.Module):
                raise GraceConfigError(
                    f"model must be a torch.nn.Module or its DDP wrapper, got {type(model).__name__}"
                )
            self._names = {param: name for name, param in module.named_parameters()}
            _check_group_is_grace_alone(grace, model)
            # e.g. the momentum memory takes over SGD's momentum (optimizer None: nothing to take over)
            grace.attach_optimizer(optimizer, {n: p for p, n in self._names.items()})
            grace.watch({n: p for p, n in self._names.items()}, optimizer, RESUME)
        elif optimizer is not None:
            raise GraceConfigError("ddp_comm_hook(grace, model, optimizer): optimizer needs the model")
        self._claim(grace)
        self._named_by_model = model is not None
        # the training thread's wait on this backward's exchanges (see _end_of_backward)
        self._timing = False
        self._pending: list[torch.futures.Future[Tensor]] = []
        self._buckets: dict[int, _Bucket] = {}  # DDP's bucket index -> what the hook needs of it
        self._seen: dict[int, weakref.ref[Tensor]] = {}  # DDP's bucket index -> its buffer, seen once

    def bucket(self, bucket: GradBucket) -> _Bucket:
        """The gradient views, names and flat span of DDP's ``bucket`` (DDP's ``gradients()``
        makes a view per parameter on every call), kept once its buffer is seen a second time:
        DDP rebuilds its buckets after the first iteration, and keeping the first ones would
        hold their buffers (the whole gradient) past it. A bucket index that turns up with
        another buffer later drops everything kept."""
        buffer, index = bucket.buffer(), bucket.index()
        known = self._buckets.get(index)
        if known is not None and known.buffer is buffer:
            return known
        if known is not None:
            self._buckets.clear()
        grads = bucket.gradients()
        known = _Bucket(buffer, grads, [self.name_of(param) for param in bucket.parameters()], flat_span(grads))
        seen = self._seen.get(index)
        if seen is not None and seen() is buffer:  # DDP's buckets are settled
            self._buckets[index] = known
        else:
            self._seen[index] = weakref.ref(buffer)
        return known

    def _end_of_backward(self) -> None:
        """Queued on autograd's engine at a backward's first bucket, so it runs at the end of
        backward ahead of DDP's own end-of-backward (queued once every bucket was handed
        over), which blocks until every bucket's Future is done: it waits for them here first,
        so the time the training thread blocks on the exchanges is measured where it blocks."""
        started = time.perf_counter()
        for future in self._pending:
            try:
                future.wait()
            except BaseException:  # DDP's own wait raises it from backward
                break
        self.grace.add_wait(time.perf_counter() - started)
        self._pending.clear()
        self._timing = False

    def name_of(self, param: Tensor) -> str:
        name = self._names.get(param)
        if name is None:
            if self._named_by_model:
                raise GraceConfigError(
                    f"DDP bucket holds a parameter of shape {tuple(param.shape)} that is not in the model "
                    f"given to ddp_comm_hook; pass the model wrapped by this DistributedDataParallel"
                )
            name = self._names[param] = f"param.{len(self._names)}"
        return name

    def __getstate__(self) -> NoReturn:
        raise TypeError(
            "GraceHookState holds a live Grace (threads, process group) and is not picklable; "
            "checkpoint state.state_dict() and restore it with load_state_dict()"
        )


class _Bucket(NamedTuple):
    buffer: Tensor  # DDP's flat buffer of the bucket (the same object every iteration)
    grads: list[Tensor]  # the parameters' gradient views into it
    names: list[str]
    span: Tensor | None  # the views as one flat tensor, when they lie back to back


def _check_group_is_grace_alone(grace: Grace, model: torch.nn.Module) -> None:
    """DDP(find_unused_parameters=True) allreduces its map of used parameters during backward,
    from autograd's thread; grace's exchanges run on its own thread. On one process group the
    two orders can differ between ranks, and then both collectives wait forever: refuse it."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or not model.find_unused_parameters:
        return
    import torch.distributed as dist

    engine = grace.engine.resolve() if hasattr(grace.engine, "resolve") else grace.engine  # "auto": chosen now
    group = getattr(engine, "group", False)  # TorchEngine: its group (None: the default one)
    if group is False:
        return
    if (group or dist.distributed_c10d._get_default_group()) is model.process_group:
        raise GraceConfigError(
            "DistributedDataParallel(find_unused_parameters=True) reduces its used-parameter map on its process "
            "group during backward, while grace exchanges on the same group from its own thread: the ranks could "
            "order the two differently and wait forever. Build grace on a group of its own: "
            "grace_dgc.build(...) without process_group (its default) or with "
            "process_group=torch.distributed.new_group() (every rank, in the same order)"
        )


# Typed by a comment: DDP's register_comm_hook refuses any annotation of ``bucket`` but
# dist.GradBucket itself (a string too), and that class is absent where torch.distributed is.
def grace_hook(state, bucket):  # type: (GraceHookState, GradBucket) -> torch.futures.Future[Tensor]
    """DDP communication hook: exchange the parameters of ``bucket`` through grace.

    Returns a Future of the bucket's flat buffer, overwritten with the averaged gradients;
    it completes on grace's communication thread when the bucket's exchange is done.
    """
    known = state.bucket(bucket)
    grads, buffer = known.grads, known.buffer
    if not state._timing:  # the first bucket of this backward: time the wait at its end
        try:
            torch.autograd.Variable._execution_engine.queue_callback(state._end_of_backward)
            state._timing = True
        except RuntimeError:  # called outside a backward (by hand): nothing blocks on it there
            pass
    # Views into DDP's flat bucket buffer, handed over: grace writes the averages into them
    # (and sums them where they lie when nothing else reads them).
    group = state.grace.step_group_async(
        grads, known.names, inplace=True, span=known.span, overlap=not bucket.is_last()
    )
    result: torch.futures.Future[Tensor] = torch.futures.Future()

    # ``done``, not ``group``: a closure over the future would make a cycle that keeps a
    # rebuilt bucket's old buffer alive until gc
    def write_back(done: Future[list[Tensor]]) -> None:
        try:
            copied = False
            for grad, average in zip(grads, done.result()):
                if average is not grad and average.data_ptr() != grad.data_ptr():
                    grad.copy_(average)
                    copied = True
            # DDP reads the buffer on its own thread's stream; the exchange synchronized its
            # own work before the Future resolved, so only copies made here need a wait
            if copied and buffer.is_cuda:
                torch.cuda.current_stream(buffer.device).synchronize()
            result.set_result(buffer)
        except BaseException as error:  # DDP re-raises it from backward's end
            result.set_exception(error)  # type: ignore[arg-type]  # torch's stub: the result's type

    group.add_done_callback(write_back)
    if state._timing:
        state._pending.append(result)
    return result


def ddp_comm_hook(
    grace: Grace, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> tuple[GraceHookState, Callable[[GraceHookState, GradBucket], torch.futures.Future[Tensor]]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    :param grace: runs over the same ranks as DDP, on a process group of its own by default
        (:func:`grace_dgc.build`); give ``process_group=`` the ranks of DDP's group when DDP
        runs over a subgroup.
    :param model: the DDP model (or the module it wraps): names the parameters after
        ``named_parameters()``; recommended, and needed by memories that read parameters.
    :param optimizer: handed to memories that take over the optimizer's momentum
        (``momentum``); with it (and ``model``), a resume that restored the optimizer's state
        but not the hook's is warned of at the first exchange.
    :returns: the hook's state (a :class:`GraceHookState`: checkpoint its ``state_dict()`` on
        every rank) and the hook.
    """
    if not hasattr(grace, "step_async"):
        raise GraceConfigError(f"ddp_comm_hook needs a Grace (grace_dgc.build(...)), got {type(grace).__name__}")
    return GraceHookState(grace, model, optimizer), grace_hook
