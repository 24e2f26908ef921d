"""The interfaces fail loudly for plugins, and the folders show the layering (issue 19).

A plugin compressor or memory written against the three small interfaces gets the safe
default: it is not chunked unless it says so, its undeclared state is named, "sends every
element" is one flag. The core (the data path, the parts, the engines) imports neither the
survey app nor the GRACE shim.
"""

from __future__ import annotations

import ast
import pathlib
import re
import warnings

import pytest
import torch
from conftest import SURVEY_SOURCE

import grace_dgc
from grace_dgc.communicators.exchange import ExchangeCommunicator
from grace_dgc.errors import GraceConfigError
from grace_dgc.interfaces import Communicator
from grace_dgc.registry import COMMUNICATORS, MEMORIES

PACKAGE = pathlib.Path(grace_dgc.__file__).parent
SURVEY = SURVEY_SOURCE  # the app on the library, apart
BOTH = (PACKAGE, SURVEY)


class HalfPrecision(grace_dgc.Compressor):
    """A plugin quantizer that says nothing about chunking or what it sends."""

    summable = True

    def compress(self, tensor, name):
        return [tensor.half()], tensor.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)


class SendsAll(HalfPrecision):
    sends_all = True


class Forgetful(grace_dgc.Memory):
    """A plugin residual memory that keeps tensors but declares no STATE."""

    def __init__(self):
        self.kept = {}

    def compensate(self, tensor, name):
        return tensor + self.kept[name] if name in self.kept else tensor

    def update(self, tensor, name, compressor, payload, ctx):
        self.kept[name] = compressor.subtract_sent_(tensor.clone(), payload, ctx)


def grace_of(compressor, memory, communicator="allgather"):
    engine = grace_dgc.create_engine("local")
    comm = COMMUNICATORS.get(communicator)(engine)
    return grace_dgc.Grace(compressor, memory, comm, engine)


def test_a_plugin_quantizer_is_not_chunked_unless_it_says_so():
    """reduce_scatter compresses chunk by chunk: a plugin that did not declare that its
    chunks are still the method is refused with the attribute to set, not chunked."""
    reduce_scatter = COMMUNICATORS.get("reduce_scatter")
    reason = reduce_scatter.refusal(HalfPrecision())
    assert reason is not None and "chunkable = True" in reason

    class Chunkable(HalfPrecision):
        chunkable = True

    assert reduce_scatter.refusal(Chunkable()) is None


def test_a_plugin_under_reduce_scatter_is_refused_at_build(monkeypatch):
    from grace_dgc.registry import COMPRESSORS

    monkeypatch.setitem(COMPRESSORS._classes, "plugin-half", HalfPrecision)
    monkeypatch.setitem(COMPRESSORS._aliases, "plugin-half", "plugin-half")
    with pytest.raises(GraceConfigError, match="chunkable = True"):
        grace_dgc.build("plugin-half", "none", "reduce_scatter", engine="local")


def test_sends_all_is_one_flag_for_the_sent_set():
    """``sends_all``: every element counts as sent, even an exact zero; without it a sent
    zero reads as not sent (the default, ``decompress != 0``)."""
    x = torch.tensor([1.5, 0.0, -2.0, 0.0])
    for compressor, expected in ((SendsAll(), [True] * 4), (HalfPrecision(), [True, False, True, False])):
        payload, ctx = compressor.compress(x, "x")
        assert compressor.sent_mask(payload, ctx).tolist() == expected
        masked = compressor.mask_sent_(torch.ones(4), payload, ctx)
        assert masked.tolist() == [0.0 if sent else 1.0 for sent in expected]


# the built-ins whose every element travels (a cast, a quantizer, a sign); the others send a
# subset: indices (topk, threshold, dgc, randomk), codes past a threshold (twobit), DCT
# coefficients (demo), low-rank factors (powersgd)
SENDS_ALL = {"none", "fp16", "bf16", "qsgd", "terngrad", "natural", "thc", "signsgd", "signum", "efsignsgd", "onebit"}


def test_every_builtin_that_sends_every_element_says_so():
    """The quantizers and casts declare ``sends_all`` and their sent set is every element
    (a rounded 0 included); the flag replaced twelve hand-written overrides. A new built-in
    must be placed on one side of the list above."""
    from grace_dgc.registry import COMPRESSORS

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x[::7] = 0.0
    for name in COMPRESSORS.names():
        compressor = COMPRESSORS.get(name)()
        assert compressor.sends_all == (name in SENDS_ALL), name
        if compressor.sends_all:
            payload, ctx = compressor.compress(x.clone(), "x")
            assert bool(compressor.sent_mask(payload, ctx).all()), name


def test_a_plugin_memory_with_undeclared_state_is_named():
    """A stateful plugin that declares no STATE would be missed by checkpoints, reset() and
    a skipped step: Grace names the attribute after the first exchange, once."""
    grace = grace_of(HalfPrecision(), Forgetful())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            grace.step(torch.randn(10), "w")
    messages = [str(w.message) for w in caught if "declares" in str(w.message)]
    assert len(messages) == 1 and "kept" in messages[0] and "STATE" in messages[0]


def test_a_plugin_memory_that_declares_its_state_is_not_warned_and_round_trips():
    class Declared(Forgetful):
        STATE = ("kept",)

    grace = grace_of(HalfPrecision(), Declared())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            grace.step(torch.randn(10), "w")
    saved = grace.memory.state_dict()
    assert torch.equal(saved["kept"]["w"], grace.memory.kept["w"])
    grace.memory.reset()
    assert grace.memory.kept == {}


def test_the_communicator_interface_is_small():
    """The data path calls one method; the whole interface stays at most 9 methods (the ninth,
    ``cost``, an optional declaration the cost model reads: issue 41)."""
    public = [
        name
        for name, value in vars(Communicator).items()
        if callable(value) or isinstance(value, classmethod)
        if not name.startswith("_")
    ]
    assert "aggregate_into" in public and len(public) <= 9, public
    for name in COMMUNICATORS.names():
        assert "aggregate_into" in vars(COMMUNICATORS.get(name)) or issubclass(
            COMMUNICATORS.get(name), ExchangeCommunicator
        ), name


def test_every_registered_memory_declares_or_owns_its_state():
    for name in MEMORIES.names():
        memory = MEMORIES.get(name)()
        assert memory.undeclared_state() == [], name


def _imports(path: pathlib.Path) -> set[str]:
    """The grace_dgc modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = ".".join(("grace_dgc",) + path.relative_to(PACKAGE).parent.parts)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith(("grace_dgc", "grace_survey"))}


@pytest.mark.parametrize("app", ["grace_survey", "grace_dgc.compat"])
def test_the_core_imports_neither_the_survey_nor_the_grace_shim(app):
    """The data path, the parts and the engines stand alone; only the package's face
    (``__init__``: ``from_params``) reaches an app (the command line finds the survey's
    subcommands through an entry point, :mod:`grace_dgc.cli_support`)."""
    core = [
        path
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] not in ("survey", "compat")
        and path.name != "__init__.py"
        or path.relative_to(PACKAGE).parts[0] in ("communicators", "compressors", "memories", "engines")
    ]
    assert len(core) > 30
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imports(path) if m == app or m.startswith(app + "."))
        for path in core
    }
    assert not {k: v for k, v in offenders.items() if v}


def _runtime_imports(path: pathlib.Path) -> set[str]:
    """The grace_dgc modules ``path`` imports when it runs (function-level imports included;
    ``if TYPE_CHECKING:`` blocks and the parent packages, which run first anyway, left out)."""
    modules = {_module(p) for package in BOTH for p in package.rglob("*.py")}
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            found.update(m for m in submodules if m in modules)
            if module in modules and any(m not in modules for m in submodules):  # a name from the module
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return {m for m in found if m != name and not name.startswith(m + ".")}


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circles_in_the_package():
    """No module imports, directly or through others, a module that imports it back (function-
    level imports count: they only postpone the circle), in the library and the survey alike.
    Issue 41 found three; none is left."""
    graph = {_module(path): _runtime_imports(path) for package in BOTH for path in package.rglob("*.py")}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for other in sorted(graph[module]):
            assert seen.get(other) != 1, "import circle: " + " -> ".join(path[path.index(other) :] + [other])
            if other not in seen:
                visit(other, path + [other])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])


def test_a_plugin_memory_of_the_earlier_attach_optimizer_form_is_refused_by_name():
    """attach_optimizer lost its unused ``grace`` argument before 0.1.0 (issue 55: no shim for a
    release that never was); a plugin still written for ``(optimizer, grace, named_parameters)``
    is told what to define instead."""
    seen = {}
    with pytest.raises(GraceConfigError, match=r"Old.attach_optimizer\(optimizer, grace, named_parameters\): the gr"):

        class Old(grace_dgc.Memory):  # refused where it is defined, before any run
            def attach_optimizer(self, optimizer, grace, named_parameters):
                seen["old"] = True

    class New(grace_dgc.Memory):
        def attach_optimizer(self, optimizer, named_parameters):
            seen["new"] = (optimizer, sorted(named_parameters))

    grace = grace_dgc.build(engine="local")
    assert "old" not in seen
    grace.memory = New()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grace.attach_optimizer(None, {"w": torch.zeros(1)})
    assert seen["new"] == (None, ["w"])


def test_the_librarys_tests_import_no_survey():
    """Issue 54: tests/core and tests/training guard the library alone, so a survey change can
    never be what breaks (or what passes) them; the survey's tests of the library's parts sit in
    tests/survey."""
    here = pathlib.Path(__file__).resolve().parents[1]
    offenders = [
        str(path.relative_to(here))
        for folder in ("core", "training")
        for path in (here / folder).glob("*.py")
        if re.search(r"^\s*(from|import) grace_survey\b", path.read_text(), flags=re.M)
    ]
    assert offenders == []


def test_the_library_knows_no_survey_but_in_its_command_line():
    """Issue 55: the survey is an app on the library; only the command line (cli*.py, where the
    survey adds its subcommands) names it."""
    package = pathlib.Path(grace_dgc.__file__).parent
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if not path.name.startswith("cli") and re.search("survey", path.read_text(), flags=re.I)
    ]
    assert offenders == []
