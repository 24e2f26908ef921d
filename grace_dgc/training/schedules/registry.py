"""The schedules' registry: a name for each, built by :func:`create`."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ...errors import GraceConfigError
from ...registry import Registry

if TYPE_CHECKING:
    from ...grace import Grace
    from .outer import OuterSync

SCHEDULES = Registry("schedule", "grace_dgc.schedules")
register_schedule = SCHEDULES.register


def list_schedules(pattern: str = "*") -> list[str]:
    """Sorted canonical schedule names matching a shell-style ``pattern``."""
    return SCHEDULES.names(pattern)


# the positional arguments every schedule takes; the others are its parameters
_WIRED = ("optimizer", "grace", "named_parameters")


class Preset:
    """A schedule that is another one with other defaults, registered by name without a class
    of its own: ``SCHEDULES.add("local_sgd", Preset(OuterSync, outer_lr=1.0, outer_momentum=0.0,
    nesterov=False, inner_steps=8))``. Called as the class is; what it builds reports the
    preset's name (in its stats, handshake and checkpoints)."""

    def __init__(self, schedule: type[Any], doc: str = "", **defaults: Any) -> None:
        unknown = sorted(set(defaults) - set(self._params_of(schedule)))
        if unknown:
            raise GraceConfigError(f"{schedule.__name__} takes no {', '.join(unknown)}")
        self.schedule, self.defaults, self.__doc__ = schedule, defaults, doc or schedule.__doc__

    def __call__(
        self,
        optimizer: torch.optim.Optimizer,
        grace: Grace,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        **params: Any,
    ) -> Any:
        built: Any = object.__new__(self.schedule)  # __init__ reads the name: set it first
        built.preset = getattr(self, "registered_name", None)  # read by Driver.name, from __init__ on
        built.__init__(optimizer, grace, named_parameters, **{**self.defaults, **params})
        return built

    def __instancecheck__(self, built: Any) -> bool:  # isinstance(schedule, DiLoCo)
        return isinstance(built, self.schedule) and built.preset == getattr(self, "registered_name", None)

    def __getattr__(self, key: str) -> Any:  # what the schedule declares (needs_adam, SETTINGS, …)
        if key.startswith("__"):
            raise AttributeError(key)
        return getattr(self.schedule, key)

    def params(self) -> list[str]:
        return self._params_of(self.schedule)

    @staticmethod
    def _params_of(schedule: type[Any]) -> list[str]:
        return [p for p in list(inspect.signature(schedule.__init__).parameters)[1:] if p not in _WIRED]

    def __repr__(self) -> str:
        listed = ", ".join(f"{key}={value!r}" for key, value in self.defaults.items())
        return f"Preset({self.schedule.__name__}{', ' if listed else ''}{listed})"


def accepted_params(name: str) -> list[str]:
    """The keyword parameters of schedule ``name`` (its settings)."""
    return [p for p in SCHEDULES.accepted_params(name) if p not in _WIRED]


def create(
    name: str,
    optimizer: torch.optim.Optimizer,
    grace: Grace,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    **params: Any,
) -> OuterSync:
    """Build the schedule registered as ``name`` over the inner ``optimizer`` and ``grace``.

    An unknown name is an error listing the valid ones (with the closest match); an unknown
    parameter is an error naming it and the parameters the schedule accepts."""
    canonical = SCHEDULES.canonical(name)
    accepted = accepted_params(canonical)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise GraceConfigError(
            f"unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for schedule "
            f"{canonical!r}. Accepted parameters: {', '.join(accepted) or '(none)'}"
        )
    schedule: OuterSync = SCHEDULES.get(canonical)(optimizer, grace, named_parameters, **params)
    return schedule
