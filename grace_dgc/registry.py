"""Name → object registries: compressors, memories and communicators (classes) here, and
any other kind that registers by name (the schedules, an app's workloads: factories).

Registration lives here, apart from the method definitions: a method module only says
``@register_compressor("topk")``. Third-party packages add methods through the
entry-point groups ``grace_dgc.compressors``, ``grace_dgc.memories`` and
``grace_dgc.communicators`` (``name = "package.module:Class"``); they are loaded the
first time a registry is listed or asked for a name it does not know. Names are
case-insensitive. A plugin whose name is already taken by another object is not loaded,
with a warning naming both; one that fails to import is remembered, with its error, as
:attr:`Registry.broken` (a warning, and the error when it is asked for by name).

A method needs no registration at all where it is named by where it lives: a *spec*,
``"package.module:Class"`` or ``"path/to/file.py:Class"`` (:func:`import_spec`, the one
importer of such specs: an app's workloads go through it too). The spec is then the
method's canonical name, so a process that only receives the name (a launched rank, a
spawned worker) imports the same class.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic

from .errors import GraceConfigError, closest, did_you_mean

if TYPE_CHECKING:
    # a bare ``Registry(...)`` is a Registry[Any] (PEP 696's default, known to type checkers;
    # Python 3.11's typing.TypeVar takes no default)
    from typing_extensions import TypeVar

    from .engines.base import Engine
    from .grace import Grace
    from .interfaces import Communicator, Compressor, Memory

    T_co = TypeVar("T_co", covariant=True, default=Any)
else:
    from typing import TypeVar

    T_co = TypeVar("T_co", covariant=True)
S = TypeVar("S")  # what one registry holds, where it registers (see Registry)


def reference(obj: object) -> str:
    """``module:qualname`` of ``obj``, as an entry point names it (a functools.partial has no
    ``__qualname__``: its repr)."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _dotted(obj: object) -> str:
    return reference(obj).replace(":", ".", 1)


# -- specs: "package.module:attr" or "path/to/file.py:attr" ----------------------------------
def is_spec(name: str) -> bool:
    """``"module:attr"`` or ``"file.py:attr"`` rather than a registered name."""
    return ":" in name


def resolve_spec(name: str, base_dir: str | None = None) -> str:
    """``name`` as another process will import it: a ``file.py:attr`` spec with an absolute
    path (relative paths are from ``base_dir``, else the working directory); others unchanged."""
    if not is_spec(name):
        return name
    target, _, attr = name.rpartition(":")
    if target.endswith(".py") and not os.path.isabs(target):
        target = os.path.abspath(os.path.join(base_dir or os.getcwd(), target))
    return f"{target}:{attr}"


def import_spec(spec: str, where: str, form: str) -> Any:
    """The object ``spec`` names: ``attr`` of ``package.module`` (imported; the working
    directory is on the path, as for ``python -m``) or of ``path/to/file.py`` (loaded from the
    file once per path, its folder on the path for its own imports). Every failure is a
    :class:`GraceConfigError` that starts with ``where`` (e.g. ``"compressor 'x.py:C'"``) and
    names what is accepted; ``form`` is what the attribute is called there (``"Class"``)."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise GraceConfigError(f"{where}: give 'package.module:{form}' or 'path/to/file.py:{form}'")
    try:
        module = _import_file(target, where) if target.endswith(".py") else _import_module(target)
    except GraceConfigError:
        raise
    except Exception as error:
        raise GraceConfigError(f"{where}: importing {target} failed: {type(error).__name__}: {error}") from error
    found = getattr(module, attr, None)
    if found is None:
        names = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        close = closest(attr, names)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise GraceConfigError(f"{where}: {target} has no {attr!r}{hint}; its callables: {', '.join(names) or 'none'}")
    return found


def _import_file(path: str, where: str) -> Any:
    if not os.path.isfile(path):
        raise GraceConfigError(f"{where}: the file {path} does not exist")
    folder = os.path.dirname(path)
    if folder not in sys.path:  # its own imports of modules beside it (`from helpers import ...`)
        sys.path.insert(0, folder)
    # one module per file (two files of one name are two modules), loaded once per process
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"grace_dgc_spec_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    module = sys.modules.get(name)
    if module is None:
        found = importlib.util.spec_from_file_location(name, path)
        assert found is not None and found.loader is not None
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        try:
            found.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # a fixed file imports on the next try
            raise
    return module


def _import_module(target: str) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # `grace-dgc` is a console script: its sys.path lacks the cwd
    return importlib.import_module(target)


_REGISTRIES: weakref.WeakSet[Registry[Any]] = weakref.WeakSet()  # every registry made (see Registry.snapshot)


class Registry(Generic[T_co]):
    """Canonical name → registered object of one ``kind`` (a method's class, a workload's
    factory), with aliases, the entry-point plugins of ``group`` (loaded at the first listing
    or unknown name) and errors that list the valid names and suggest the closest.

    ``members`` is what the registry's objects are called in a broken plugin's warning ("the
    other methods work"); ``stamp``: each registered object is given its canonical name as
    ``registered_name`` (classes; a workload's factories are not stamped, and may be
    registered under several names); ``check(name, obj)`` refuses what may not be registered
    (raising :class:`GraceConfigError`), plugins included; ``unknown_hint`` ends the error for
    an unknown name. ``spec_check(where, obj)``, where given, lets a spec (:func:`is_spec`)
    stand for a name: the object it imports, once ``spec_check`` accepts it (raising
    :class:`GraceConfigError`, its message starting with ``where``, if not), is not registered,
    and the spec (its file made absolute) is its canonical name.

    A registry is read as its type says: a ``Registry[type[Compressor]]`` gives compressor
    classes, and is a ``Registry[type[Part]]`` where one is read (``T_co`` is covariant, so
    registries of different kinds are listed together). Registering is typed through
    ``self`` (``add(self: Registry[S], obj: S)``): a registry takes what its declared type
    holds."""

    def __init__(
        self,
        kind: str,
        group: str,
        *,
        members: str = "methods",
        stamp: bool = True,
        check: Callable[[str, T_co], None] | None = None,
        unknown_hint: str = "",
        spec_check: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.kind = kind  # "compressor", "memory", "communicator", "schedule", "workload"
        self.group = group  # entry-point group
        self.members = members
        self.stamp = stamp
        self.check = check
        self.unknown_hint = unknown_hint
        self.spec_check = spec_check
        self._entries: dict[str, T_co] = {}  # canonical name -> registered object
        self._aliases: dict[str, str] = {}  # every accepted name (canonical ones included) -> canonical name
        self._plugins_loaded = False
        self.broken: dict[str, str] = {}  # plugin name -> why it failed to load
        # builds a composite from registered objects, for a name joined by ">" (compressors:
        # chains, grace_dgc.compressors.chain); it stands in for a registered object. None:
        # such names are unknown
        self.compose: Callable[[list[T_co]], Any] | None = None
        _REGISTRIES.add(self)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, str], bool, dict[str, str]]:
        """What is registered now, for :meth:`restore` (ranks kept up across jobs,
        :class:`grace_dgc.launch.RankPool`, start each job with the registries a fresh process has)."""
        return dict(self._entries), dict(self._aliases), self._plugins_loaded, dict(self.broken)

    def restore(self, snapshot: tuple[dict[str, Any], dict[str, str], bool, dict[str, str]]) -> None:
        """Forget what was registered since ``snapshot`` was taken."""
        entries, aliases, loaded, broken = snapshot
        self._entries, self._aliases, self._plugins_loaded, self.broken = (
            dict(entries),
            dict(aliases),
            loaded,
            dict(broken),
        )

    @property
    def _classes(self) -> dict[str, T_co]:
        """The registered objects by canonical name (the name the method registries' tests use)."""
        return self._entries

    @_classes.setter
    def _classes(self, entries: dict[str, Any]) -> None:
        self._entries = entries

    # -- registering -------------------------------------------------------------------
    def register(self: Registry[S], name: str, aliases: Sequence[str] = ()) -> Callable[[S], S]:
        """Decorator: ``@registry.register("twobit", aliases=("2bit",))``."""

        def decorator(obj: S) -> S:
            self.add(name, obj, aliases)
            return obj

        return decorator

    def add(self: Registry[S], name: str, obj: S, aliases: Sequence[str] = ()) -> None:
        """Register ``obj`` as ``name`` (and ``aliases``); a name another object holds is an error."""
        if self.check is not None:
            self.check(name, obj)
        keys = [key.lower() for key in (name, *aliases)]
        for key in keys:
            owner = self._aliases.get(key)
            if owner is not None and self._entries[owner] is not obj:
                raise GraceConfigError(f"{self.kind} name {key!r} is already taken by {_dotted(self._entries[owner])}")
        self._entries[keys[0]] = obj
        if self.stamp:
            obj.registered_name = keys[0]  # type: ignore[attr-defined]
        for key in keys:
            self._aliases[key] = keys[0]

    # -- plugins -----------------------------------------------------------------------
    def load_plugins(self, force: bool = False) -> None:
        """Register every entry point of this registry's group (once, unless ``force``)."""
        if self._plugins_loaded and not force:
            return
        self._plugins_loaded = True
        for entry in importlib.metadata.entry_points(group=self.group):
            self._load_plugin(entry)

    def _load_plugin(self, entry: importlib.metadata.EntryPoint) -> None:
        """One entry point: registered, or warned about (its name is taken by another object),
        or remembered as broken; the others load either way."""
        key = entry.name.lower()
        dist = getattr(getattr(entry, "dist", None), "name", "an unknown distribution")
        plugin = f"the {self.kind} plugin {entry.name!r} ({entry.value}, from {dist})"
        if key in self._aliases:  # the same object (its module registered it already) is no clash
            owner = self._entries[self._aliases[key]]
            if reference(owner) != entry.value:
                warnings.warn(
                    f"grace_dgc: {plugin} is not loaded: the name is taken by {_dotted(owner)}; "
                    "register it under another name",
                    stacklevel=3,
                )
            return
        try:
            obj = entry.load()
        except Exception as error:
            self._broken(key, f"{plugin} failed to import", error)
            return
        if self.stamp and any(obj is known for known in self._entries.values()):
            return  # its module registered it when imported: a stamped object keeps its one name
        try:
            self.add(entry.name, obj)
        except Exception as error:
            self._broken(key, f"{plugin} could not be registered", error)
            return
        self.broken.pop(key, None)

    def _broken(self, key: str, what: str, error: Exception) -> None:
        self.broken[key] = f"{what}: {type(error).__name__}: {error}"
        warnings.warn(f"grace_dgc: {self.broken[key]}; the other {self.members} work", stacklevel=4)

    # -- looking up --------------------------------------------------------------------
    def names(self, pattern: str = "*") -> list[str]:
        """Sorted canonical names matching a shell-style ``pattern`` (case-insensitive)."""
        self.load_plugins()
        return sorted(n for n in self._entries if fnmatch.fnmatchcase(n, pattern.lower()))

    def aliases_of(self, name: str) -> list[str]:
        """The other names of canonical ``name``, sorted."""
        return sorted(a for a, n in self._aliases.items() if n == name and a != name)

    def canonical(self, name: str) -> str:
        """The canonical name of ``name`` (an alias, any case; a spec, with its file made
        absolute), else an error that lists the valid names and suggests the closest (or says
        why a plugin of that name is broken, or why a spec does not import)."""
        if not isinstance(name, str):
            raise GraceConfigError(f"{self.kind} must be given by name (a str), got {name!r}")
        if self.compose is not None and ">" in name:  # a composite: each stage by its own name
            stages = [self.canonical(stage.strip()) for stage in name.split(">")]
            self.compose([self._lookup(stage) for stage in stages])  # refuses what cannot be composed
            return ">".join(stages)
        if self.spec_check is not None and is_spec(name):
            spec = resolve_spec(name.strip())
            self._import(spec)  # an error here, where the name is given
            return spec
        key = name.lower()
        if key not in self._aliases:
            self.load_plugins()
        if key in self.broken:
            raise GraceConfigError(self.broken[key])
        if key not in self._aliases:
            hint = did_you_mean(key, sorted(self._aliases))
            raise GraceConfigError(
                f"unknown {self.kind} {name!r}.{hint} Valid names: {', '.join(self.names())}{self.unknown_hint}"
            )
        return self._aliases[key]

    def _import(self, spec: str) -> Any:
        """The object an absolute ``spec`` names, checked by ``spec_check``; a class without a
        name of its own (``registered_name`` in its own ``__dict__``: its decorator's) is given
        the spec as its name, so that the ranks' handshake and a checkpoint name it alike."""
        assert self.spec_check is not None
        where = f"{self.kind} {spec!r}"
        obj = import_spec(spec, where, "Class")
        self.spec_check(where, obj)
        if self.stamp and "registered_name" not in vars(obj):
            obj.registered_name = spec
        return obj

    def _lookup(self, canonical: str) -> Any:
        """The object of a canonical name (a spec's imported anew: a pooled rank's registries
        forget what a job registered, not the modules it imported)."""
        if self.spec_check is not None and is_spec(canonical):
            return self._import(canonical)
        return self._entries[canonical]

    def get(self, name: str) -> T_co:
        """The object registered as ``name`` (a composite's stand-in for a name with ``>``;
        the class a spec names)."""
        canonical = self.canonical(name)
        if ">" in canonical and self.compose is not None:
            composite: T_co = self.compose([self._lookup(stage) for stage in canonical.split(">")])
            return composite
        found: T_co = self._lookup(canonical)
        return found

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


def _hint(kind: str, group: str) -> str:
    """The end of an unknown method name's error: the forms that need no registration, and
    where a registered class is known."""
    return (
        f"; or your own class as 'package.module:Class' or 'path/to/file.py:Class' (a class registered "
        f"with @register_{kind} is known only in a process that imported its module, and launched ranks "
        f"import only what their config names: name it in one of those forms, or install it with a '{group}' "
        "entry point; docs/plugins.md)"
    )


def _part_class(interface: str) -> Callable[[str, Any], None]:
    """``spec_check`` of a method registry: the spec names a subclass of ``interface``."""

    def check(where: str, obj: Any) -> None:
        from . import interfaces

        base = getattr(interfaces, interface)
        if not (isinstance(obj, type) and issubclass(obj, base)):
            what = obj.__name__ if isinstance(obj, type) else f"a {type(obj).__name__}"
            raise GraceConfigError(f"{where} is {what}, not a class derived from grace_dgc.{interface}")

    return check


def _method_registry(kind: str, group: str, interface: str) -> Any:
    return Registry(kind, group, unknown_hint=_hint(kind, group), spec_check=_part_class(interface))


COMPRESSORS: Registry[type[Compressor]] = _method_registry("compressor", "grace_dgc.compressors", "Compressor")
MEMORIES: Registry[type[Memory]] = _method_registry("memory", "grace_dgc.memories", "Memory")
COMMUNICATORS: Registry[type[Communicator]] = _method_registry(
    "communicator", "grace_dgc.communicators", "Communicator"
)

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


# -- build: three names and their parameters, composed into a Grace --------------------------
def _route(params: dict[str, Any], parts: list[tuple[str, Registry, str]]) -> dict[str, dict[str, Any]]:
    """Split ``params`` among the parts whose constructors accept them (GRACE passes one
    flat dict); a parameter no part accepts is an error naming what each part accepts."""
    routed: dict[str, dict[str, Any]] = {kind: {} for kind, _, _ in parts}
    for key, value in params.items():
        takers = [kind for kind, registry, name in parts if key in registry.accepted_params(name)]
        if not takers:
            accepted = "; ".join(
                f"{kind} {name!r}: {', '.join(registry.accepted_params(name)) or '(none)'}"
                for kind, registry, name in parts
            )
            known = [p for _, registry, name in parts for p in registry.accepted_params(name)]
            raise GraceConfigError(
                f"unknown parameter {key!r}.{did_you_mean(key, known)} Accepted parameters: {accepted}"
            )
        for kind in takers:
            routed[kind][key] = value
    return routed


def _engine(engine: str | Engine, process_group: Any, timeout: float | None) -> Engine:
    """The Grace's engine: over a process group of its own unless one is given (see :func:`build`)."""
    from .engines import create_engine
    from .engines.torch_engine import OWN_GROUP

    kwargs = {
        key: value for key, value in (("process_group", process_group), ("timeout", timeout)) if value is not None
    }
    if process_group is None and engine in ("auto", "torch"):  # grace's traffic apart from the user's
        kwargs["process_group"] = OWN_GROUP
    return create_engine(engine, **kwargs)


def build(
    compressor: str = "none",
    memory: str = "none",
    communicator: str = "allreduce",
    engine: str | Engine = "auto",
    process_group: Any = None,
    timeout: float | None = None,
    nonfinite: str = "skip",
    world_size: int | None = None,
    **params: Any,
) -> Grace:
    """Compose a :class:`Grace` from three registered names and their parameters.

    ``engine`` is ``auto`` / ``local`` / ``torch`` / ``horovod`` or an Engine instance;
    ``process_group`` selects a torch.distributed group and ``timeout`` (seconds, default
    300) bounds each of its collectives. Without ``process_group`` the Grace makes a group
    of its own over every rank (``torch.distributed.new_group``, so every rank builds its
    Graces in the same order): its exchanges, which run on its communication thread, then
    never compete for one order with the training loop's own collectives or another Grace's
    (:meth:`Grace.close` releases it). Pass ``torch.distributed.group.WORLD`` to share the
    default group. ``nonfinite`` says what a NaN/Inf gradient on any
    rank does: ``"skip"`` (every rank skips that group's exchange, state untouched) or
    ``"raise"``. ``world_size``, when given, is the number of ranks the run expects: it is
    what ``grace.world_size`` says before the engine is chosen, and a different number of
    ranks at the first exchange is an error. Other keyword arguments go to whichever of the three parts accepts them.
    """
    from .grace import Grace, check_nonfinite  # the data path imports the registries: built here, at run time

    asked = (
        ("compressor", COMPRESSORS, compressor),
        ("memory", MEMORIES, memory),
        ("communicator", COMMUNICATORS, communicator),
    )
    parts = [(kind, registry, registry.canonical(name)) for kind, registry, name in asked]
    names = {kind: name for kind, _, name in parts}
    routed = _route(params, parts)
    check_nonfinite(nonfinite)  # every value is checked before the parts' pairing
    comp = COMPRESSORS.get(names["compressor"])(**routed["compressor"])
    mem = MEMORIES.get(names["memory"])(**routed["memory"])
    eng = _engine(engine, process_group, timeout)
    comm = COMMUNICATORS.get(names["communicator"])(eng, **routed["communicator"])
    reason = comm.refuse(comp)
    if reason:
        fitting = [c for c in COMMUNICATORS.names() if COMMUNICATORS.get(c).fits(comp)]
        raise GraceConfigError(
            f"communicator {names['communicator']!r} cannot carry compressor {names['compressor']!r}: "
            f"{reason}; communicators that can: {', '.join(fitting)}"
        )
    grace = Grace(comp, mem, comm, eng, nonfinite=nonfinite, world_size=world_size)
    grace.params = routed
    return grace
