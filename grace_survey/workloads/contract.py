"""The contract of a survey workload: what the survey trains (:class:`Workload`), the
hyper-parameters a config may override, and the checks of both (what was wrong and what is
accepted). Apart from :mod:`grace_survey.workloads.registry` (the names) and
:mod:`grace_survey.workloads.builtin` (the built-ins) so that a workload module, the built-in
ones included, imports the contract without importing the registry that imports it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from grace_dgc.errors import GraceConfigError, check_range
from grace_survey.workloads.data import Split, check_split

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

#: a workload factory: ``factory(data_dir, seed, **options)`` returning a :class:`Workload`
Factory = TypeVar("Factory", bound=Callable[..., Workload])

MAX_EPOCHS = 100_000  # a survey cell longer than this is a typo, not a plan

# a numeric hyper-parameter's range: (low, high, low_open, kind)
_RANGES: dict[str, tuple[float, float | None, bool, type]] = {
    "batch_size": (1, None, False, int),
    "lr": (0, None, True, float),
    "momentum": (0, 1, False, float),
    "epochs": (1, MAX_EPOCHS, False, int),
    "target_accuracy": (0, 1, False, float),
    "weight_decay": (0, None, False, float),
    "lr_gamma": (0, None, True, float),
}


def check_workload(workload: Workload) -> None:
    """Every field a user's factory fills, checked once with what was wrong and what is accepted."""
    where = f"workload {workload.name!r}"
    workload.train = check_split(workload.train, f"{where}: train")
    workload.test = check_split(workload.test, f"{where}: test")
    if workload.valid is not None:
        workload.valid = check_split(workload.valid, f"{where}: valid")
    if not callable(workload.make_model):
        raise GraceConfigError(f"{where}: make_model must be a function returning a torch.nn.Module")
    if not (workload.loss in LOSSES or callable(workload.loss)):
        raise GraceConfigError(
            f"{where}: loss = {workload.loss!r}; accepted: {', '.join(LOSSES)} or a function (output, targets) -> loss"
        )
    if workload.metric is not None and not callable(workload.metric):
        raise GraceConfigError(f"{where}: metric must be a function (output, targets) -> (sum, count)")
    if workload.augment is not None and not callable(workload.augment):
        raise GraceConfigError(f"{where}: augment must be a function (inputs, generator) -> inputs")
    workload.loader_workers = check_range(f"{where}: loader_workers", workload.loader_workers, 0, 64, kind=int)
    check_hyper_parameters({k: getattr(workload, k) for k in HYPER_PARAMETERS}, where)


def check_hyper_parameters(hyper: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """The hyper-parameters in ``hyper``, range-checked (the error names ``where`` and the key)."""
    prefix = f"{where}: " if where else ""
    return {key: _checked_value(prefix, key, value) for key, value in hyper.items()}


def _checked_value(prefix: str, key: str, value: Any) -> Any:
    """One hyper-parameter, checked (``prefix`` starts its error)."""
    if key in _RANGES:
        low, high, low_open, kind = _RANGES[key]
        if key == "target_accuracy" and value is None:
            return None  # no target: the run reports no time to target
        return check_range(prefix + key, value, low, high, low_open=low_open, kind=kind)
    if key == "grad_clip":
        return None if value is None else check_range(prefix + key, value, 0, None, low_open=True)
    if key in ("optimizer", "lr_schedule"):
        accepted = OPTIMIZERS if key == "optimizer" else LR_SCHEDULES
        if value not in accepted:
            raise GraceConfigError(f"{prefix}{key}={value!r}; accepted: {', '.join(accepted)}")
        return value
    if key == "warmup_steps":
        return check_range(prefix + key, value, 0, None, kind=int)
    if key == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise GraceConfigError(f"{prefix}betas={value!r} must be two numbers in [0, 1), e.g. [0.9, 0.99]")
        return tuple(check_range(f"{prefix}betas[{i}]", b, 0, 1, high_open=True) for i, b in enumerate(value))
    # lr_milestones
    epochs = isinstance(value, (list, tuple)) and all(
        isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in value
    )
    if not epochs:
        raise GraceConfigError(f"{prefix}lr_milestones={value!r} must be a list of epochs (ints >= 1)")
    return tuple(value)
