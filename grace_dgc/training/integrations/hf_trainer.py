"""The Hugging Face ``Trainer``: grace_dgc in one call before ``train``.

    from grace_dgc.training.integrations.hf_trainer import attach

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    attach(trainer, "topk", "residual", "allgather", compress_ratio=0.01)
    trainer.train()                                  # or train(resume_from_checkpoint=True)

The Trainer runs on Accelerate and exposes no DDP hook; :func:`attach` adds a
:class:`GraceCallback` (first in line) that

1. at ``on_train_begin``, once the Trainer has wrapped the model in DDP and built the
   optimizer, registers :func:`grace_dgc.ddp_comm_hook` on ``trainer.model_wrapped``;
2. at ``on_save`` (every process: the gather is a collective) writes every rank's grace state
   into the checkpoint folder as ``grace_dgc.pt``, beside the Trainer's own files; the
   Trainer itself keeps the main process's state only;
3. on resume (``train(resume_from_checkpoint=...)``: a folder, or True for the last one in
   ``output_dir``) loads each rank's part from that folder's ``grace_dgc.pt``; another method,
   settings or world size is refused by name, and a folder without the file (a dense run's)
   is warned of and trained on with grace's state empty (the integrations' one rule). The Trainer tells callbacks
   neither the folder nor whether it resumed, so :func:`attach` wraps this trainer's
   ``train`` to note its argument (the instance's method only; the class is untouched);
4. adds ``grace/<stat>`` to every ``logs`` the Trainer reports (its trackers and
   ``state.log_history``), and hands the epoch to the parts that follow one.

Gradient accumulation (``gradient_accumulation_steps``) runs the micro-batches under DDP's
``no_sync``: grace runs once per optimizer step.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ...errors import GraceConfigError
from ...grace import Grace
from ...registry import build
from ..checkpoint import gather_state, load_gathered_state
from ..ddp import GraceHookState, ddp_comm_hook
from . import logged_stats, own_group, warn_of_a_checkpoint_without_grace

STATE_FILE = "grace_dgc.pt"


class GraceCallback(TrainerCallback):
    """The Trainer's side of grace_dgc (module docstring); made by :func:`attach`."""

    def __init__(self, trainer: Trainer, method: tuple[str, str, str], nonfinite: str, params: dict[str, Any]) -> None:
        self.trainer = trainer
        self.method, self.nonfinite, self.params = method, nonfinite, params
        self.grace: Grace | None = None
        self.hook_state: GraceHookState | None = None
        self._hooked: torch.nn.Module | None = None
        self.resume_from: str | None = None  # the folder train() resumes from (attach notes it)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise GraceConfigError(
                f"grace_dgc needs the Trainer's model in DistributedDataParallel (a multi-process launch, "
                f"e.g. torchrun); the Trainer wrapped it as {type(model).__name__}"
            )
        if self.hook_state is None or self._hooked is not model:  # a second train() keeps its hook
            self.grace = build(
                *self.method, engine="torch", process_group=own_group(), nonfinite=self.nonfinite, **self.params
            )
            optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)  # Accelerate's wrapper
            self.hook_state, hook = ddp_comm_hook(self.grace, model, optimizer)
            model.register_comm_hook(self.hook_state, hook)
            self._hooked = model
        if self.resume_from:
            self._restore(self.resume_from, state.global_step)

    def _restore(self, folder: str, step: int) -> None:
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            warn_of_a_checkpoint_without_grace(self.grace, f"{folder} (step {step}; no {STATE_FILE})")
            return
        load_gathered_state(self.grace, torch.load(path, weights_only=True))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.grace is None:
            return
        gathered = gather_state(self.grace)  # every process: a collective
        if gathered is not None:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(gathered, os.path.join(folder, STATE_FILE))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.grace is not None:
            self.grace.set_epoch(int(state.epoch or 0))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.grace is None or logs is None:
            return
        stats = logged_stats(self.grace.stats())
        logs.update(stats)  # the callbacks after this one (trackers) see them
        if state.log_history:
            state.log_history[-1].update(stats)


def attach(
    trainer: Trainer,
    compressor: str = "none",
    memory: str = "none",
    communicator: str = "allreduce",
    *,
    nonfinite: str = "skip",
    **params: Any,
) -> GraceCallback:
    """Train ``trainer``'s model with a grace_dgc method (named as in :func:`grace_dgc.build`):
    adds a :class:`GraceCallback` ahead of the Trainer's other callbacks and returns it (its
    ``grace`` exists once training begins)."""
    if not isinstance(trainer, Trainer):
        raise GraceConfigError(f"attach needs a transformers.Trainer, got {type(trainer).__name__}")
    if any(isinstance(c, GraceCallback) for c in trainer.callback_handler.callbacks):
        raise GraceConfigError("this Trainer already has a grace_dgc method attached")
    build(compressor, memory, communicator, engine="local", nonfinite=nonfinite, **params)  # names checked now
    callback = GraceCallback(trainer, (compressor, memory, communicator), nonfinite, params)
    trainer.callback_handler.callbacks.insert(0, callback)  # first: later callbacks (trackers) log its stats
    train = trainer.train

    @functools.wraps(train)
    def train_noting_the_resume(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(trainer.args.output_dir)
        callback.resume_from = folder or None
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_noting_the_resume  # type: ignore[method-assign]
    return callback
