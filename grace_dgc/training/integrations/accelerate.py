"""Hugging Face Accelerate: grace_dgc in one call after ``accelerator.prepare``.

    from grace_dgc.training.integrations.accelerate import attach

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    grace = attach(accelerator, model, "topk", "residual", "allgather", optimizer=optimizer, compress_ratio=0.01)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        grace.log_stats(step)                          # grace/<stat> through accelerator.log

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes its own enum only (fp16,
bf16, PowerSGD); :func:`attach` registers :func:`grace_dgc.ddp_comm_hook` on the prepared
model instead, and hooks the returned :class:`GraceAccelerate` into ``save_state`` and
``load_state``: ``save_state`` (every process calls it) gathers every rank's grace state into
``grace_dgc.pt`` beside Accelerate's files, written by the main process, and ``load_state``
gives each rank its own part back, refusing another method, settings or world size by name; a
folder without that file (a dense run's) is warned of and trained on with grace's state empty.
Accelerate itself saves the main process's custom state only, so a residual would otherwise be
lost. ``accelerator.accumulate`` runs the micro-batches under DDP's ``no_sync``: grace runs
once per optimizer step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ...errors import GraceConfigError
from ...grace import Grace
from ...registry import build
from ..checkpoint import gather_state, load_gathered_state
from ..ddp import GraceHookState, grace_hook
from . import logged_stats, own_group, warn_of_a_checkpoint_without_grace

STATE_FILE = "grace_dgc.pt"  # every rank's state, beside Accelerate's files (as the Trainer's callback)

log = logging.getLogger(__name__)


class GraceAccelerate(GraceHookState):
    """The DDP hook's state on an Accelerate-prepared model (its ``stats()`` and per-rank
    ``state_dict()`` are the hook's, :class:`~grace_dgc.training.ddp.GraceHookState`), hooked into
    ``save_state`` and ``load_state`` (:meth:`save_into`, :meth:`load_from`)."""

    def __init__(self, accelerator: Any, grace: Grace, model: torch.nn.Module, optimizer: Any) -> None:
        super().__init__(grace, model, optimizer)
        self.accelerator = accelerator

    def save_into(self, models: Any, weights: Any, output_dir: str) -> None:
        """``save_state``'s pre-hook (every process: the gather is a collective): every rank's
        state into ``output_dir/grace_dgc.pt``, written by the main process."""
        gathered = gather_state(self.grace)
        if gathered is not None:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(gathered, os.path.join(output_dir, STATE_FILE))

    def load_from(self, models: Any, input_dir: str) -> None:
        """``load_state``'s pre-hook: each rank's part of ``input_dir/grace_dgc.pt``; a folder
        without it (a dense run's) is warned of and trained on with grace's state empty."""
        path = os.path.join(input_dir, STATE_FILE)
        readable = os.path.exists(path)
        everywhere = self.grace.engine.allgather(torch.tensor([int(readable)], device=self.grace.engine.control_device))
        if not any(int(flag) for flag in everywhere):
            warn_of_a_checkpoint_without_grace(self.grace, f"{input_dir} (no {STATE_FILE})")
            return
        load_gathered_state(self.grace, torch.load(path, weights_only=True) if readable else None)

    def log_stats(self, step: int | None = None) -> None:
        """``grace/<stat>`` (bytes, ratio, phase times) through ``accelerator.log`` (its trackers)."""
        self.accelerator.log(logged_stats(self.grace.stats()), step=step)

    def set_epoch(self, epoch: int) -> None:
        """Hand the epoch to the parts that follow one (DGC's warm-up)."""
        self.grace.set_epoch(epoch)


def attach(
    accelerator: Any,
    model: torch.nn.Module,
    compressor: str = "none",
    memory: str = "none",
    communicator: str = "allreduce",
    *,
    optimizer: Any = None,
    grace: Callable[[], Grace] | None = None,
    nonfinite: str = "skip",
    **params: Any,
) -> GraceAccelerate:
    """Compress the gradients of ``model`` (as ``accelerator.prepare`` returned it) with a
    grace_dgc method, named as in :func:`grace_dgc.build` (or ``grace``: a function returning
    a built Grace). ``optimizer``: the prepared optimizer,
    for memories that take over its momentum (``momentum``). Registers the returned object
    for ``save_state``/``load_state``. One process: nothing is exchanged, so no hook is
    registered (a warning says so)."""
    if grace is not None and ((compressor, memory, communicator) != ("none", "none", "allreduce") or params):
        raise GraceConfigError("attach takes the method by name or a grace function, not both")
    if not isinstance(model, DistributedDataParallel):
        if accelerator.num_processes > 1:
            raise GraceConfigError(
                f"attach needs the model accelerator.prepare returned, a DistributedDataParallel; got "
                f"{type(model).__name__} under {accelerator.num_processes} processes (call attach after prepare)"
            )
        log.warning("one process: nothing to exchange, so grace_dgc's hook is not registered")
    made = grace() if grace is not None else None
    if made is None:
        if isinstance(model, DistributedDataParallel):
            params["process_group"] = own_group()
        engine = "torch" if isinstance(model, DistributedDataParallel) else "local"
        made = build(compressor, memory, communicator, engine=engine, nonfinite=nonfinite, **params)
    if not isinstance(made, Grace):
        raise GraceConfigError(f"grace= must return a Grace, returned {type(made).__name__}")
    attached = GraceAccelerate(accelerator, made, model, getattr(optimizer, "optimizer", optimizer))
    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(attached, grace_hook)
    # its own file beside Accelerate's, as the Trainer's callback writes: a dense run's folder then
    # lacks only that file, which the one rule handles (register_for_checkpointing would make
    # Accelerate's load fail with its own missing-file error)
    # the latest attach owns the checkpoint: an earlier one's Grace (a model replaced) would write
    # the same file, or load a state of another method
    for handle in getattr(accelerator, "_grace_dgc_hooks", ()):
        handle.remove()
    accelerator._grace_dgc_hooks = (
        accelerator.register_save_state_pre_hook(attached.save_into),
        accelerator.register_load_state_pre_hook(attached.load_from),
    )
    return attached
