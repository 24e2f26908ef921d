"""The schedules' registry: a name for each, built by :func:`create`, and the check every
schedule's ``load_state_dict`` makes first."""

from __future__ import annotations

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

STATE_FORMAT = 1


def list_schedules(pattern: str = "*") -> list[str]:
    """Sorted canonical schedule names matching a shell-style ``pattern``."""
    return SCHEDULES.names(pattern)


# the positional arguments every schedule takes; the others are its parameters
_WIRED = ("optimizer", "grace", "named_parameters")


def refuse_other_state(
    state: Any, keys: tuple[str, ...], name: str, mine: dict[str, Any], may_differ: dict[str, str]
) -> None:
    """What every schedule's ``load_state_dict`` checks first, before anything is loaded: a
    dict with ``keys``, of this format, saved by schedule ``name`` with settings equal to
    ``mine`` (except those in ``may_differ``); else a :class:`GraceConfigError` naming what differs."""
    if not isinstance(state, dict) or any(key not in state for key in keys):
        got = f"keys {sorted(state)[:8]}" if isinstance(state, dict) else type(state).__name__
        raise GraceConfigError(f"load_state_dict needs a schedule's state_dict() (with {', '.join(keys)}); got {got}")
    if state["format"] != STATE_FORMAT:
        raise GraceConfigError(f"schedule state format {state['format']!r} is not supported; accepted: {STATE_FORMAT}")
    if state["schedule"] != name:
        raise GraceConfigError(
            f"the state was saved by schedule {state['schedule']!r}; this one is {name!r}: "
            "build the same schedule to resume"
        )
    saved = state["settings"]
    differing = [
        f"{key}: saved {saved.get(key, '(not set)')!r}, this run {mine.get(key, '(not set)')!r}"
        for key in sorted(set(saved) | set(mine))
        if saved.get(key, "(not set)") != mine.get(key, "(not set)") and key not in may_differ
    ]
    if differing:
        raise GraceConfigError(
            f"the state was saved with other settings of schedule {name!r}: {'; '.join(differing)}. "
            "Build with the saved settings to resume"
        )


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
