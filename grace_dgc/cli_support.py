"""What every ``grace-dgc`` subcommand shares, below the library's CLI (:mod:`grace_dgc.cli`)
and the apps that add subcommands to it (the survey, :mod:`grace_survey.cli`): one-line
user errors, and where subcommands and listings come from.

Subcommands arrive through the entry-point group ``grace_dgc.commands`` (each a function that
adds its parsers to the ``grace-dgc`` subparsers) and ``grace-dgc list`` listings through
``grace_dgc.listings`` (each a function returning the text to print): the survey declares its
own in pyproject.toml, so the library's CLI imports no app. Where the package runs without
its metadata (a source tree on ``PYTHONPATH``), the survey's are found by name."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
from collections.abc import Callable
from typing import Any, NoReturn

from .errors import GraceConfigError, GraceDataError, closest

COMMANDS_GROUP, LISTINGS_GROUP = "grace_dgc.commands", "grace_dgc.listings"
# what pyproject.toml declares for the survey: used where no installed metadata says it
_BUILT_IN = {
    COMMANDS_GROUP: {"survey": "grace_survey.cli:add_subcommands"},
    LISTINGS_GROUP: {"workloads": "grace_survey.workloads.registry:workloads_table"},
}

#: what a user's input can cause: one line and exit 2 (FileNotFoundError: a config or data file)
USER_ERRORS: tuple[type[BaseException], ...] = (GraceConfigError, GraceDataError, FileNotFoundError, NotADirectoryError)


def debug_requested(args: argparse.Namespace | None = None) -> bool:
    """``--debug`` was given or ``GRACE_DGC_DEBUG`` is set (not to 0): show full tracebacks."""
    return bool(getattr(args, "debug", False)) or os.environ.get("GRACE_DGC_DEBUG", "") not in ("", "0")


def error_line(error: object, prog: str = "grace-dgc") -> str:
    """The one line a user error ends in: ``grace-dgc: error: <message>`` (whitespace folded)."""
    return f"{prog}: error: {' '.join(str(error).split())}"


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block: it points at ``--help`` instead) and
    a suggestion for a misspelt choice (a subcommand, ``--launcher`` ...)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{error_line(message, self.prog)}; see {self.prog} --help\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(choice) for choice in action.choices]
            close = closest(str(value), choices)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint}; accepted: {', '.join(choices)}")


def _load(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _group(group: str) -> dict[str, Any]:
    """``{name: object}`` of an entry-point group, the built-in names where none is installed."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}
    targets = {name: ep.value for name, ep in found.items()} or dict(_BUILT_IN[group])
    return {name: _load(target) for name, target in sorted(targets.items())}


def command_providers() -> list[Callable[[Any], Any]]:
    """The functions that add subcommands to ``grace-dgc`` (the survey's: survey, report, project)."""
    return list(_group(COMMANDS_GROUP).values())


def listings() -> dict[str, Callable[[], str]]:
    """``grace-dgc list``'s listings besides the methods: name → a function giving the text."""
    return _group(LISTINGS_GROUP)
