"""Name → class registries for compressors, memories and communicators.

Registration lives here, apart from the method definitions: a method module only says
``@register_compressor("topk")``. Third-party packages add methods through the
entry-point groups ``grace_dgc.compressors``, ``grace_dgc.memories`` and
``grace_dgc.communicators`` (``name = "package.module:Class"``); they are loaded the
first time a registry is listed or asked for a name it does not know.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .errors import GraceConfigError

T = TypeVar("T")


class Registry:
    def __init__(self, kind: str, group: str) -> None:
        self.kind = kind  # "compressor", "memory", "communicator"
        self.group = group  # entry-point group
        self._classes: dict[str, Any] = {}  # canonical name -> class
        self._aliases: dict[str, str] = {}  # alias -> canonical name
        self._plugins_loaded = False
        self.broken: dict[str, str] = {}  # plugin name -> why it failed to load
        # builds a composite from registered classes, for a name joined by ">" (compressors:
        # chains, grace_dgc.compressors.chain); None: such names are unknown
        self.compose: Callable[[list[Any]], Any] | None = None

    def register(self, name: str, aliases: Sequence[str] = ()) -> Callable[[type[T]], type[T]]:
        """Class decorator: ``@registry.register("twobit", aliases=("2bit",))``."""

        def decorator(cls: type[T]) -> type[T]:
            self._add(name, cls, aliases)
            return cls

        return decorator

    def _add(self, name: str, cls: type, aliases: Sequence[str] = ()) -> None:
        for key in (name, *aliases):
            owner = self._aliases.get(key)
            if owner is not None and self._classes[owner] is not cls:
                raise GraceConfigError(
                    f"{self.kind} name {key!r} is already taken by {self._classes[owner].__qualname__}"
                )
        self._classes[name] = cls
        cls.registered_name = name  # type: ignore[attr-defined]
        for key in (name, *aliases):
            self._aliases[key] = name

    def load_plugins(self, force: bool = False) -> None:
        """Import every entry point of this registry's group (once, unless ``force``)."""
        if self._plugins_loaded and not force:
            return
        self._plugins_loaded = True
        for entry in importlib.metadata.entry_points(group=self.group):
            if entry.name in self._aliases:
                continue
            try:
                cls = entry.load()
            except Exception as error:
                dist = getattr(getattr(entry, "dist", None), "name", "an unknown distribution")
                self.broken[entry.name] = (
                    f"the {self.kind} plugin {entry.name!r} ({entry.value}, from "
                    f"{dist}) failed to import: {type(error).__name__}: {error}"
                )
                warnings.warn(f"grace_dgc: {self.broken[entry.name]}; the other methods work", stacklevel=2)
                continue
            if getattr(cls, "registered_name", None) not in self._classes:
                self._add(entry.name, cls)

    def names(self, pattern: str = "*") -> list[str]:
        self.load_plugins()
        return sorted(n for n in self._classes if fnmatch.fnmatchcase(n, pattern))

    def canonical(self, name: str) -> str:
        if not isinstance(name, str):
            raise GraceConfigError(f"{self.kind} must be given by name (a str), got {name!r}")
        if self.compose is not None and ">" in name:  # a composite: each stage by its own name
            stages = [self.canonical(stage.strip()) for stage in name.split(">")]
            self.compose([self._classes[stage] for stage in stages])  # refuses what cannot be composed
            return ">".join(stages)
        key = name.lower()
        if key not in self._aliases:
            self.load_plugins()
        if key in self.broken:
            raise GraceConfigError(self.broken[key])
        if key not in self._aliases:
            known = sorted(self._aliases)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise GraceConfigError(f"unknown {self.kind} {name!r}.{hint} Valid names: {', '.join(self.names())}")
        return self._aliases[key]

    def get(self, name: str) -> Any:
        canonical = self.canonical(name)
        if ">" in canonical and self.compose is not None:
            return self.compose([self._classes[stage] for stage in canonical.split(">")])
        return self._classes[canonical]

    def accepted_params(self, name: str) -> list[str]:
        """Keyword parameters the class's constructor accepts (``engine`` is wired by build);
        a composite's: those of any of its stages."""
        target: Any = self.get(name)
        if not isinstance(target, type):
            return list(target.params())
        sig = inspect.signature(target.__init__)  # type: ignore[misc]
        return [
            p.name
            for p in list(sig.parameters.values())[1:]
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "engine"
        ]


COMPRESSORS = Registry("compressor", "grace_dgc.compressors")
MEMORIES = Registry("memory", "grace_dgc.memories")
COMMUNICATORS = Registry("communicator", "grace_dgc.communicators")

register_compressor = COMPRESSORS.register
register_memory = MEMORIES.register
register_communicator = COMMUNICATORS.register


def list_compressors(pattern: str = "*") -> list[str]:
    """Sorted canonical compressor names matching a shell-style ``pattern``."""
    return COMPRESSORS.names(pattern)


def list_memories(pattern: str = "*") -> list[str]:
    return MEMORIES.names(pattern)


def list_communicators(pattern: str = "*") -> list[str]:
    return COMMUNICATORS.names(pattern)
