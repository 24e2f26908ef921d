"""The contract of a survey workload: what the survey trains (:class:`Workload`) and the
hyper-parameters a config may override. Apart from :mod:`grace_survey.workloads.registry` (the
registry and the built-ins) so that a workload module, the built-in text workload included,
imports the contract without importing the registry that imports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grace_survey.workloads.data import Split

LossFn = Callable[[Tensor, Tensor], Tensor]  # (output, targets) -> the batch's mean loss
MetricFn = Callable[[Tensor, Tensor], tuple[Any, Any]]  # (output, targets) -> (Σ score, count)
LOSSES = ("cross_entropy", "lm")


@dataclass(kw_only=True)
class Workload:
    """What the survey trains: the data, the model and how to score it, and the default
    hyper-parameters (a survey config may override any of :data:`HYPER_PARAMETERS`).

    Required: ``train``, ``test`` and ``make_model``. A split is ``(inputs, targets)``
    tensors or a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs,
    streamed through a DataLoader (:mod:`grace_survey.workloads.data`). ``make_model()`` is
    called right after ``torch.manual_seed(seed)``, so every method starts from the same
    weights: it must draw its initial values from torch's global generator.

    ``loss``: ``"cross_entropy"`` (output (N, classes) against class indices), ``"lm"``
    (output (N, T, vocab) against the next tokens (N, T)), or a function
    ``loss(output, targets)`` returning the batch's mean loss. ``metric(output, targets)``
    returns ``(sum of the batch's scores, number of scores)`` — numbers or 0-d tensors —
    and higher must be better, in [0, 1] like an accuracy (``target_accuracy`` is checked to
    lie there); the default is the accuracy of ``output.argmax(-1)``.
    ``metric_name`` names it in the report; ``target_accuracy`` is the value of the metric
    that time-to-target measures to (None: the run reports no time to target).
    """

    train: Split
    test: Split
    make_model: Callable[[], torch.nn.Module]
    loss: str | LossFn = "cross_entropy"
    metric: MetricFn | None = None
    metric_name: str = ""  # default: "accuracy", "next-token accuracy" for "lm"
    batch_size: int = 32  # per worker
    lr: float = 0.05  # the peak learning rate
    optimizer: str = "sgd"  # "sgd" (momentum, weight_decay) or "adamw" (betas, weight_decay decoupled)
    momentum: float = 0.9  # SGD's
    betas: tuple = (0.9, 0.999)  # AdamW's
    epochs: int = 10
    target_accuracy: float | None = None  # for time/epochs-to-target
    name: str = ""  # set to the name it was asked for
    description: str = ""
    augment: Callable | None = None  # augment(inputs_batch, torch.Generator) -> batch (train, tensor splits)
    valid: Split | None = None  # a held-out split when the dataset ships one (PTB): lr tuning scores on it
    weight_decay: float = 0.0
    lr_milestones: tuple = ()  # epochs after which lr *= lr_gamma (MultiStepLR)
    lr_gamma: float = 0.1
    lr_schedule: str = "step"  # "step": the milestones above; "cosine": cosine decay to lr/10 over the run
    warmup_steps: int = 0  # linear warm-up from 0 over the first steps (either schedule)
    grad_clip: float | None = None  # clip the gradient's global norm to this (LSTM)
    loader_workers: int = 0  # DataLoader worker processes per rank for Dataset splits
    parameters: int = 0  # trainable parameters of make_model() (measured)
    info: dict = field(default_factory=dict)  # dataset/model facts: source, shapes, classes, vocab

    def __post_init__(self) -> None:
        if not self.metric_name:
            self.metric_name = "next-token accuracy" if self.loss == "lm" else "accuracy"


OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("step", "cosine")
HYPER_PARAMETERS = (
    "batch_size",
    "lr",
    "optimizer",
    "momentum",
    "betas",
    "lr_schedule",
    "warmup_steps",
    "epochs",
    "target_accuracy",
    "weight_decay",
    "lr_milestones",
    "lr_gamma",
    "grad_clip",
)
