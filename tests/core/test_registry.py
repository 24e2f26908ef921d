"""Registry, build/from_params and bad-input errors."""

import sys
import textwrap

import pytest
import torch
from conftest import install_dummy_distribution

import grace_dgc
from grace_dgc import GraceConfigError
from grace_dgc.registry import COMPRESSORS, Registry


def test_lists_are_sorted_canonical_and_filtered():
    names = grace_dgc.list_compressors()
    assert names == sorted(names)
    assert {"none", "fp16", "bf16", "topk", "randomk", "threshold"} <= set(names)
    assert "half" not in names  # aliases are not listed
    assert grace_dgc.list_compressors("*k") == [n for n in names if n.endswith("k")]
    assert grace_dgc.list_compressors("fp1?") == ["fp16"]
    assert grace_dgc.list_memories("res*") == ["residual"]
    assert grace_dgc.list_communicators() == [
        "allgather",
        "allreduce",
        "auto",
        "broadcast",
        "hierarchical",
        "reduce_scatter",
        "sparse_allreduce",
    ]


def test_aliases_resolve_to_canonical_names():
    assert COMPRESSORS.canonical("half") == "fp16"
    assert COMPRESSORS.canonical("TopK") == "topk"
    grace = grace_dgc.build("half", "ef", engine="local")
    assert grace.compressor.registered_name == "fp16"
    assert grace.memory.registered_name == "residual"


def test_unknown_name_lists_valid_names_and_closest_match():
    with pytest.raises(GraceConfigError) as err:
        grace_dgc.build("topc")
    msg = str(err.value)
    assert "unknown compressor 'topc'" in msg and "Did you mean 'topk'?" in msg
    for name in grace_dgc.list_compressors():
        assert name in msg
    with pytest.raises(GraceConfigError, match="unknown memory 'residul'.*'residual'"):
        grace_dgc.build(memory="residul")
    with pytest.raises(GraceConfigError, match="unknown communicator"):
        grace_dgc.build(communicator="alltoall")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"compressor": "topk", "compress_ratio": 0}, r"compress_ratio=0 is out of range; accepted: \(0, 1\]"),
        ({"compressor": "topk", "compress_ratio": 1.5}, r"compress_ratio=1.5 is out of range"),
        ({"compressor": "randomk", "compress_ratio": "a lot"}, r"compress_ratio='a lot' must be a number"),
        ({"compressor": "threshold", "threshold": -1}, r"threshold=-1 is out of range; accepted: \[0, inf\]"),
        ({"compressor": "randomk", "seed": 1.5}, r"seed=1.5 must be a number of type int"),
        ({"memory": "residual", "beta": -0.1}, r"beta=-0.1 is out of range"),
    ],
)
def test_out_of_range_parameters_are_named(params, message):
    params = {"communicator": "allgather", **params}
    with pytest.raises(GraceConfigError, match=message):
        grace_dgc.build(engine="local", **params)


def test_unknown_parameter_names_what_each_part_accepts():
    with pytest.raises(GraceConfigError) as err:
        grace_dgc.build("topk", "residual", "allgather", ratio=0.1)
    msg = str(err.value)
    assert "unknown parameter 'ratio'" in msg
    assert "compressor 'topk': compress_ratio" in msg and "memory 'residual': beta, gamma" in msg


def test_non_summable_with_allreduce_is_refused_at_build():
    with pytest.raises(GraceConfigError) as err:
        grace_dgc.build("topk", communicator="allreduce")
    assert "cannot be summed" in str(err.value) and "allgather, auto, broadcast" in str(err.value)


def test_parameters_are_routed_to_the_parts_that_accept_them():
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.25, beta=0.5, engine="local")
    assert grace.compressor.compress_ratio == 0.25
    assert grace.memory.beta == 0.5 and grace.memory.gamma == 1.0


def test_from_params_accepts_grace_dicts():
    params = {
        "compressor": "topk",
        "memory": "residual",
        "communicator": "allgather",
        "compress_ratio": 0.3,
        "world_size": 4,
        "threshold": None,
    }
    grace = grace_dgc.from_params(params)
    assert (grace.compressor.registered_name, grace.memory.registered_name, grace.communicator.registered_name) == (
        "topk",
        "residual",
        "allgather",
    )
    assert grace.compressor.compress_ratio == 0.3
    assert repr(grace).startswith("Grace(compressor='topk'")
    assert grace_dgc.from_params({}).compressor.registered_name == "none"


@pytest.mark.parametrize(
    "params, message",
    [({"momentum": 1.5}, r"momentum=1.5 is out of range; accepted: \[0, 1\)"), ({"nonfinite": "ignore"}, "nonfinite=")],
)
def test_a_bad_value_is_named_before_the_parts_pairing(params, message):
    """dgc over the default allreduce is also a bad pairing: the bad value is named first."""
    with pytest.raises(GraceConfigError, match=message):
        grace_dgc.build("dgc", "momentum", **params)


def test_a_bad_outer_communicator_is_named_as_outer():
    with pytest.raises(GraceConfigError, match=r"hierarchical\(outer='bogus'\): unknown communicator 'bogus'"):
        grace_dgc.build("none", "none", "hierarchical", outer="bogus", engine="local")


def test_unknown_engine_is_refused():
    with pytest.raises(GraceConfigError, match="unknown engine 'mpi'; accepted: auto, horovod, local, torch$"):
        grace_dgc.build(engine="mpi")
    with pytest.raises(GraceConfigError, match="needs an initialized process group"):
        grace_dgc.build(engine="torch")


def test_decorator_registration_and_name_clash():
    reg = Registry("compressor", "grace_dgc.test-nothing")

    @reg.register("mine", aliases=("my",))
    class Mine(grace_dgc.Compressor):
        pass

    assert reg.names() == ["mine"] and reg.get("my") is Mine
    with pytest.raises(GraceConfigError, match="already taken"):

        @reg.register("other", aliases=("mine",))
        class Other(grace_dgc.Compressor):
            pass


def test_plugin_from_an_installed_distribution(tmp_path, monkeypatch):
    """A real (dummy) distribution on sys.path whose entry point names a compressor."""
    (tmp_path / "negate_plugin.py").write_text(
        textwrap.dedent("""
        import grace_dgc

        class Negate(grace_dgc.Compressor):
            '''Sends -g and flips it back (a test plugin).'''
            summable = True

            def __init__(self, scale=1.0):
                self.scale = scale

            def compress(self, tensor, name):
                return [-tensor * self.scale], None

            def decompress(self, payload, ctx):
                return -payload[0] / self.scale
    """)
    )
    install_dummy_distribution(
        tmp_path, monkeypatch, "negate-plugin", "[grace_dgc.compressors]\nnegate = negate_plugin:Negate\n"
    )
    assert "negate" in grace_dgc.list_compressors()
    grace = grace_dgc.build("negate", scale=2.0, engine="local")
    out = grace.step(torch.tensor([1.0, -3.0]), "w")
    assert torch.equal(out, torch.tensor([1.0, -3.0]))
    assert sys.modules["negate_plugin"].Negate.registered_name == "negate"


def test_cli_list_prints_the_registry(capsys):
    from grace_dgc.cli import main

    main(["list"])
    out = capsys.readouterr().out
    for name in grace_dgc.list_compressors() + grace_dgc.list_memories():
        assert name in out


@pytest.mark.parametrize("page", ["README.md", "docs/methods.md"])
def test_readme_methods_table_matches_the_registry(page):
    """The README's and the Methods page's table is generated by `grace-dgc list --markdown`;
    keep them in sync."""
    from pathlib import Path

    from grace_dgc.cli import registry_table

    text = (Path(__file__).parent.parent.parent / page).read_text()
    assert registry_table(markdown=True) in text, (
        f"{page}'s methods table is stale: regenerate it with `grace-dgc list --markdown`"
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: grace_dgc.build("none", engine="local", timeout=0),
            r"timeout=0 is out of range; accepted: \(0, inf\]",
        ),
        (lambda: grace_dgc.build("none", engine="local", timeout=-5), r"timeout=-5 is out of range"),
        (
            lambda: grace_dgc.build("dgc", "momentum", "allgather", engine="local", warmup_ratios={0: 0.1}),
            "warmup_ratios",
        ),
        (
            lambda: grace_dgc.DistributedOptimizer(
                torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
                grace=grace_dgc.build("none", engine="local"),
                backward_passes_per_step=True,
            ),
            r"backward_passes_per_step=True; accepted: an int >= 1",
        ),
    ],
)
def test_settings_that_looked_valid_are_refused_by_name(make, message):
    """Issue 20: each of these was accepted and failed later (or never)."""
    with pytest.raises(GraceConfigError, match=message):
        make()


def test_numpy_booleans_are_booleans():
    import numpy as np

    from grace_dgc.compat import _clipping
    from grace_dgc.errors import check_bool

    assert check_bool("flag", np.True_) is True and check_bool("flag", np.False_) is False
    assert _clipping(np.False_) is None and _clipping(np.True_) == _clipping(True)


def test_a_checkpoint_of_a_differently_shaped_model_is_refused_at_load():
    """Issue 20: it was accepted and failed one step later."""

    def trained(width, steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
        optimizer = grace_dgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            grace=grace_dgc.build("topk", "residual", "allgather", engine="local"),
            named_parameters=model.named_parameters(),
        )
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
        return optimizer

    checkpoint = trained(8, 2).state_dict()
    trained(8, 0).load_state_dict(checkpoint)  # the same model loads
    with pytest.raises(
        GraceConfigError, match=r"differently shaped model: momentum_buffer of '0.weight': \(8, 4\) for \(6, 4\)"
    ):
        trained(6, 0).load_state_dict(checkpoint)
    with pytest.raises(
        GraceConfigError, match=r"grace\['memory'\]\['residuals'\]\['0.weight'\]: 32 elements for \(6, 4\)"
    ):
        trained(6, 0).load_state_dict(
            {"optimizer": trained(6, 1).state_dict()["optimizer"], "grace": checkpoint["grace"]}
        )
