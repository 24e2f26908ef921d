"""PyTorch Lightning: grace_dgc as a DDP strategy.

    from grace_dgc.training.integrations.lightning import GraceDDPStrategy

    trainer = lightning.pytorch.Trainer(
        accelerator="cpu", devices=2,
        strategy=GraceDDPStrategy("topk", "residual", "allgather", compress_ratio=0.01),
    )

or from a LightningCLI config, by class path::

    trainer:
      strategy:
        class_path: grace_dgc.training.integrations.lightning.GraceDDPStrategy
        init_args: {compressor: topk, memory: residual, communicator: allgather, params: {compress_ratio: 0.01}}

What it adds to Lightning's :class:`DDPStrategy`:

1. the Grace is built once the process group exists (``setup_environment``), on the CPU
   (gloo) as on CUDA (NCCL) — Lightning's own ``ddp_comm_hook`` argument is registered on
   CUDA only;
2. after DDP wraps the model and the optimizer exists, :func:`grace_dgc.ddp_comm_hook` is
   registered with both (names from ``named_parameters()``; the ``momentum`` memory takes
   over SGD's momentum as with ``DistributedOptimizer``);
3. ``trainer.save_checkpoint`` (every rank calls it) gathers every rank's grace state into
   rank 0's checkpoint under ``"grace_dgc"``; on resume (``fit(ckpt_path=...)``) each rank
   loads its own part, and another method, settings or world size is refused by name.
   Lightning itself writes rank 0's state only, so a residual would otherwise be lost;
4. ``grace/<stat>`` (bytes, ratio, phase times: :data:`grace_dgc.training.integrations.LOGGED`) is
   logged with ``log_dict`` after every optimizer step (its own exchange counted), and the epoch is handed to the parts
   that follow one (DGC's warm-up).

Gradient accumulation (``accumulate_grad_batches``) runs the micro-batches under DDP's
``no_sync``, so the hook, and grace, run once per optimizer step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel

from ...errors import GraceConfigError
from ...grace import Grace
from ...registry import build
from ..checkpoint import gather_state, load_gathered_state
from ..ddp import GraceHookState, ddp_comm_hook
from . import logged_stats, own_group, warn_of_a_checkpoint_without_grace

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "grace_dgc"
# DDPStrategy's own arguments, passed through; every other keyword is the method's parameter
_STRATEGY_ARGS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "model_averaging_period",
    "process_group_backend",
    "timeout",
    "start_method",
)
_HOOK_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")
_NOT_LOADED = object()


class GraceDDPStrategy(DDPStrategy):
    """DDP with a grace_dgc method on its gradients (module docstring).

    ``compressor``, ``memory``, ``communicator`` and the method's parameters (``params``, or
    as keywords: ``compress_ratio=0.01``) are those of :func:`grace_dgc.build`. ``grace``: a
    function returning a built Grace instead (called once the process group exists).
    ``ddp_kwargs``: options of
    ``DistributedDataParallel`` itself (``find_unused_parameters`` …). ``log_stats``: log
    ``grace/<stat>`` after every optimizer step.

    How ``**kwargs`` is shared: a keyword that is one of ``DDPStrategy``'s own arguments
    (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
    ``precision_plugin``, ``model_averaging_period``, ``process_group_backend``, ``timeout``,
    ``start_method``) goes to ``DDPStrategy``; every other keyword is a parameter of the
    method (``compress_ratio=0.01``), routed to its part as by :func:`grace_dgc.build`, where an
    unknown one is an error naming what each part accepts. ``DistributedDataParallel``'s own
    options go in ``ddp_kwargs``; DDPStrategy's hook arguments (``ddp_comm_hook`` …) are
    refused, since this strategy registers grace's hook.
    """

    strategy_name = "grace_ddp"

    def __init__(
        self,
        compressor: str = "none",
        memory: str = "none",
        communicator: str = "allreduce",
        *,
        params: dict[str, Any] | None = None,
        grace: Callable[[], Grace] | None = None,
        nonfinite: str = "skip",
        log_stats: bool = True,
        ddp_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        taken = sorted(set(_HOOK_ARGS) & kwargs.keys())
        if taken:
            raise GraceConfigError(
                f"GraceDDPStrategy registers grace's own DDP hook; {', '.join(taken)} cannot be given "
                "(use DDPStrategy for another hook)"
            )
        passed = {key: kwargs.pop(key) for key in list(kwargs) if key in _STRATEGY_ARGS}
        super().__init__(**passed, **(ddp_kwargs or {}))
        self.method = (compressor, memory, communicator)
        self.method_params = {**(params or {}), **kwargs}
        if grace is not None and (self.method != ("none", "none", "allreduce") or self.method_params):
            raise GraceConfigError(
                "GraceDDPStrategy takes the method by name or a grace function, not both: "
                f"got grace={getattr(grace, '__name__', grace)!r} and {self.method} {self.method_params}"
            )
        self._make_grace = grace
        self.nonfinite = nonfinite
        self.log_stats = log_stats
        self.grace: Grace | None = None
        self.hook_state: GraceHookState | None = None
        self._loaded: Any = _NOT_LOADED  # the checkpoint's gathered state, until the hook exists

    def setup_environment(self) -> None:
        super().setup_environment()  # the process group
        if self._make_grace is not None:
            self.grace = self._make_grace()
            if not isinstance(self.grace, Grace):
                raise GraceConfigError(f"grace= must return a Grace, returned {type(self.grace).__name__}")
        else:
            self.grace = build(
                *self.method, engine="torch", process_group=own_group(), nonfinite=self.nonfinite, **self.method_params
            )

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # DDP wraps the model; the optimizers exist
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.grace is not None and isinstance(self.model, DistributedDataParallel)
        if len(self.optimizers) > 1 and self.grace.memory.registered_name == "momentum":
            raise GraceConfigError(
                f"the momentum memory takes over one SGD optimizer's momentum; this module has {len(self.optimizers)}"
            )
        optimizer = self.optimizers[0] if len(self.optimizers) == 1 else None
        self.hook_state, hook = ddp_comm_hook(self.grace, self.model, optimizer)
        self.model.register_comm_hook(self.hook_state, hook)
        self._restore()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank calls it (Lightning's rule): the gather is a collective; rank 0 writes."""
        if self.grace is not None and self.hook_state is not None:
            gathered = gather_state(self.grace)
            if self.is_global_zero:
                checkpoint = {**checkpoint, CHECKPOINT_KEY: gathered}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._loaded = checkpoint.get(CHECKPOINT_KEY)
        if self.hook_state is not None:  # restored after setup (restore_checkpoint_after_setup)
            self._restore()
        return checkpoint

    def _restore(self) -> None:
        loaded, self._loaded = self._loaded, _NOT_LOADED
        if loaded is _NOT_LOADED:
            return
        if loaded is None:
            warn_of_a_checkpoint_without_grace(self.grace, "the checkpoint")
            return
        load_gathered_state(self.grace, loaded)  # another method, settings or world size: refused by name

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.grace is not None:
            self.grace.set_epoch(self.lightning_module.current_epoch)  # type: ignore[union-attr]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # logged after the step's exchange (the closure runs the backward), not in training_step,
        # where the counters were still the previous step's (the first row read zeros)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_stats and self.grace is not None and self.hook_state is not None:
            module = self.lightning_module
            assert module is not None
            module.log_dict(logged_stats(self.grace.stats()), on_step=True, on_epoch=False, batch_size=1)
        return output
