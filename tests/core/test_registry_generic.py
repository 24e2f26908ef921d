"""The one Registry every kind registers in (issue 41): methods' classes and workloads'
factories alike, with the same plugin rules. A plugin whose name is taken by another object
is not loaded and is warned about, naming both (the method registries skipped it silently);
the same object declared again is no clash; a plugin that subclasses a registered class gets
its own name (it inherited the parent's ``registered_name``, and was skipped)."""

import warnings

import pytest
from conftest import install_dummy_distribution

import grace_dgc
from grace_dgc.compressors.topk import TopKCompressor
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMPRESSORS, Registry, reference

PLUGIN = """
from grace_dgc.compressors.topk import TopKCompressor

class FasterTopK(TopKCompressor):
    '''A plugin subclass of a registered class (a test plugin).'''

class Other(TopKCompressor):
    pass
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "subclass_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "subclass_plugin"


def test_a_plugin_whose_name_is_taken_is_warned_about_and_the_owner_kept(tmp_path, monkeypatch, plugin_module):
    install_dummy_distribution(
        tmp_path,
        monkeypatch,
        "clashing-plugin",
        f"[grace_dgc.compressors]\ntopk = {plugin_module}:Other\nHalf = {plugin_module}:Other\n",
    )
    with pytest.warns(UserWarning) as warned:
        names = grace_dgc.list_compressors()
    messages = [str(w.message) for w in warned]
    assert (
        f"grace_dgc: the compressor plugin 'topk' ({plugin_module}:Other, from clashing-plugin) is not loaded: "
        "the name is taken by grace_dgc.compressors.topk.TopKCompressor; register it under another name"
    ) in messages
    assert any("plugin 'Half'" in m and "taken by grace_dgc.compressors.fp16.FP16Compressor" in m for m in messages)
    assert COMPRESSORS.get("topk") is TopKCompressor and COMPRESSORS.get("half").registered_name == "fp16"
    assert names.count("topk") == 1 and "half" not in names


def test_the_same_object_declared_again_is_no_clash(tmp_path, monkeypatch):
    install_dummy_distribution(
        tmp_path,
        monkeypatch,
        "same-object",
        f"[grace_dgc.compressors]\ntopk = {reference(TopKCompressor)}\n",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "topk" in grace_dgc.list_compressors()
    assert COMPRESSORS.get("topk") is TopKCompressor


def test_a_plugin_subclass_of_a_registered_class_gets_its_own_name(tmp_path, monkeypatch, plugin_module):
    install_dummy_distribution(
        tmp_path, monkeypatch, "subclass-plugin", f"[grace_dgc.compressors]\nfaster_topk = {plugin_module}:FasterTopK\n"
    )
    assert "faster_topk" in grace_dgc.list_compressors()
    plugin = COMPRESSORS.get("faster_topk")
    assert plugin.__name__ == "FasterTopK" and plugin.registered_name == "faster_topk"
    assert TopKCompressor.registered_name == "topk"
    grace = grace_dgc.build("faster_topk", "residual", "allgather", engine="local")
    assert grace.compressor.registered_name == "faster_topk"


def test_names_are_case_insensitive_everywhere():
    reg = Registry("compressor", "grace_dgc.test-nothing")

    @reg.register("Mine", aliases=("MY",))
    class Mine(grace_dgc.Compressor):
        pass

    assert Mine.registered_name == "mine" and reg.names() == ["mine"] and reg.names("MI*") == ["mine"]
    assert reg.get("MINE") is Mine and reg.get("my") is Mine and reg.aliases_of("mine") == ["my"]
    with pytest.raises(GraceConfigError, match="compressor name 'my' is already taken by .*Mine"):
        reg.register("other", aliases=("My",))(type("Other", (grace_dgc.Compressor,), {}))


def _refuse_non_callables(name: str, obj: object) -> None:
    if not callable(obj):
        raise GraceConfigError(f"thing {name!r} must be callable, got {obj!r}")


def test_a_registry_of_factories_stamps_nothing_and_checks_what_it_takes(tmp_path, monkeypatch):
    """Objects, not classes: a workload's factories. Not stamped, registered under several
    names, refused by the registry's check (a plugin too: remembered as broken, by name)."""
    reg: Registry[object] = Registry(
        "thing", "grace_dgc.test-things", members="things", stamp=False, check=_refuse_non_callables,
        unknown_hint="; or your own",
    )  # fmt: skip

    def make() -> int:
        return 1

    reg.register("one")(make)
    reg.add("uno", make)
    assert reg.get("ONE") is reg.get("uno") is make and not hasattr(make, "registered_name")
    assert reg.names() == ["one", "uno"]
    with pytest.raises(GraceConfigError, match="thing 'two' must be callable"):
        reg.add("two", 2)
    with pytest.raises(GraceConfigError, match=r"unknown thing 'onn'. Did you mean 'one'\? Valid names: one, uno; or"):
        reg.get("onn")
    (tmp_path / "things_plugin.py").write_text("value = 3\n")
    entry_points = "[grace_dgc.test-things]\nthree = things_plugin:value\n"
    install_dummy_distribution(tmp_path, monkeypatch, "things", entry_points)
    with pytest.warns(UserWarning, match=r"plugin 'three' \(things_plugin:value, from things\) could not be regis"):
        reg.load_plugins(force=True)
    with pytest.raises(GraceConfigError, match="thing 'three' must be callable, got 3"):
        reg.get("three")
