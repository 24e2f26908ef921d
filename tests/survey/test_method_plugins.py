"""A user's own compressor, memory and communicator in a survey: named by where they live
(``path/to/file.py:Class``, ``package.module:Class``) with no package to install, imported on
every rank; a plugin's refusal of its parameters as one line naming the method; and the
errors for a misspelt method or parameter, each with its place in the config and the closest
name (issue 56, points 3, 4 and 9)."""

import textwrap

import pytest

from grace_dgc.cli import main
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import COMMUNICATORS, COMPRESSORS, MEMORIES
from grace_survey.config import settings as cfg
from grace_survey.running import runner

# the user's file: a compressor registered with the decorator and a communicator that is not
METHODS_FILE = textwrap.dedent(
    """
    import torch
    import grace_dgc
    from grace_dgc.communicators.allgather import Allgather


    @grace_dgc.register_compressor("signtopk")
    class SignTopK(grace_dgc.Compressor):
        \"\"\"The signs of the k largest magnitudes, their indices, and the mean magnitude.\"\"\"

        SETTINGS = ("k",)

        def __init__(self, k=4):
            if k < 1:
                raise ValueError(f"k={k} must be >= 1")
            self.k = k

        def compress(self, tensor, name):
            flat = tensor.reshape(-1)
            indices = flat.abs().topk(min(self.k, flat.numel())).indices
            scale = flat.abs().mean().reshape(1)
            return [flat[indices].sign(), indices, scale], (tensor.shape, flat.numel())

        def decompress(self, payload, ctx):
            signs, indices, scale = payload
            shape, numel = ctx
            out = torch.zeros(numel, dtype=signs.dtype, device=signs.device)
            out[indices] = signs * scale
            return out.view(shape)


    class PlainAllgather(Allgather):
        \"\"\"Allgather under another name: registered nowhere.\"\"\"

    """
)

# the workload, in a file of its own: a survey's process and its ranks import it, not the methods' file
WORKLOAD_FILE = textwrap.dedent(
    """
    import torch
    from grace_survey import Workload


    def make(data_dir=None, seed=0):
        g = torch.Generator().manual_seed(7)
        x, xt = torch.randn(256, 12, generator=g), torch.randn(64, 12, generator=g)
        return Workload(
            train=(x, (x[:, :3].sum(1) > 0).long()), test=(xt, (xt[:, :3].sum(1) > 0).long()),
            make_model=lambda: torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
            batch_size=16, lr=0.1, epochs=1, description="teacher task",
        )
    """
)

# a module on the path, named as package.module:Class: a memory registered nowhere
MEMORY_MODULE = textwrap.dedent(
    """
    from grace_dgc.memories.residual import ResidualMemory


    class DampedResidual(ResidualMemory):
        def __init__(self, beta=0.5, gamma=1.0):
            if not 0 <= beta <= 1:
                raise ValueError(f"beta={beta} must be in [0, 1]")
            super().__init__(beta, gamma)
    """
)


@pytest.fixture
def registries():
    """The method registries as they are, put back after the test (the decorator in the
    user's file registers ``signtopk`` in this process when the file is imported)."""
    saved = {registry: registry.snapshot() for registry in (COMPRESSORS, MEMORIES, COMMUNICATORS)}
    yield
    for registry, snapshot in saved.items():
        registry.restore(snapshot)


@pytest.fixture
def user(tmp_path, monkeypatch, registries):
    """``user/my_methods.py`` and ``user/my_workload.py`` (named by their paths) and
    ``my_memories.py`` in a folder on sys.path (spawned ranks inherit it), a config folder
    beside them."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "my_methods.py").write_text(METHODS_FILE)
    (folder / "my_workload.py").write_text(WORKLOAD_FILE)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_memories.py").write_text(MEMORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    (tmp_path / "conf").mkdir()
    return folder


def write_config(tmp_path, methods, seeds=(0,)):
    path = tmp_path / "conf" / "survey.toml"
    path.write_text(f'workload = "../user/my_workload.py:make"\nworkers = 2\nseeds = {list(seeds)}\n{methods}')
    return str(path)


def one_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_the_users_own_three_parts_named_by_file_and_module_train_on_two_ranks(user, tmp_path):
    toml = write_config(
        tmp_path,
        """
        [[methods]]
        compressor = "../user/my_methods.py:SignTopK"
        memory = "my_memories:DampedResidual"
        communicator = "../user/my_methods.py:PlainAllgather"
        fusion_bytes = 0
        params = {k = 4, beta = 0.5}
        """,
        seeds=(0, 1),  # two runs on the same kept-up ranks: the second finds the module imported, its name forgotten
    )
    conf = cfg.load_config(toml)
    file = user / "my_methods.py"
    method = conf.methods[0]
    assert method["compressor"] == f"{file}:SignTopK"  # relative to the TOML's folder, made absolute
    assert method["communicator"] == f"{file}:PlainAllgather" and method["memory"] == "my_memories:DampedResidual"
    assert method["label"] == "signtopk"  # the name its decorator gave it
    assert conf.to_dict()["methods"][0]["compressor"] == f"{file}:SignTopK"  # the saved config imports the same
    summaries, failures = runner.run_grid(conf, str(tmp_path / "out"), progress=False, log=lambda *a: None)
    assert not failures and len(summaries) == 2, failures
    for run in summaries:
        # every rank built SignTopK and sent what it compresses: per tensor (one per bucket) k fp32 signs,
        # k int64 indices and one fp32 scale (the bias of 2 elements: 2 of each), and allgather's header
        # (an int64 length per payload tensor)
        header = 3 * 8
        assert run["bytes_per_step"] == 3 * (4 * 4 + 4 * 8 + 4 + header) + (2 * 4 + 2 * 8 + 4 + header)
        assert run["dense_bytes_per_step"] == 4 * (12 * 16 + 16 + 16 * 2 + 2)


def test_a_decorator_registered_plugin_is_unknown_by_name_and_the_error_says_how_to_name_it(user, tmp_path, capsys):
    toml = write_config(tmp_path, '[[methods]]\ncompressor = "signtopk"\n')
    assert main(["survey", "--config", toml, "--out", str(tmp_path / "out")]) == 2
    line = one_line(capsys)
    assert "methods[0]: unknown compressor 'signtopk'. Did you mean 'topk'?" in line
    assert "'package.module:Class' or 'path/to/file.py:Class'" in line
    assert "@register_compressor" in line and "'grace_dgc.compressors' entry point" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("method", "refused"),
    [
        (
            'compressor = "../user/my_methods.py:SignTopK"\nparams = {k = 0}',
            "methods[0] ('signtopk') on 2 workers: compressor '{file}:SignTopK' refused its parameters (k=0): "
            "ValueError: k=0 must be >= 1",
        ),
        (
            'label = "damped"\ncompressor = "topk"\nmemory = "my_memories:DampedResidual"\n'
            "params = {compress_ratio = 0.1, beta = 2}",
            "methods[0] ('damped') on 2 workers: memory 'my_memories:DampedResidual' refused its parameters "
            "(compress_ratio=0.1, beta=2): ValueError: beta=2 must be in [0, 1]",
        ),
    ],
)
def test_a_plugins_value_error_is_one_line_naming_the_method_and_its_parameters(
    user, tmp_path, capsys, method, refused
):
    toml = write_config(tmp_path, f"[[methods]]\n{method}\n")
    assert main(["survey", "--config", toml, "--out", str(tmp_path / "out")]) == 2  # as every config error
    assert one_line(capsys) == "grace-dgc: error: " + refused.format(file=user / "my_methods.py")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ('compressor = "topkk"', "methods[1] ('b'): unknown compressor 'topkk'. Did you mean 'topk'? Valid names: "),
        (
            'compressor = "topk"\nmemory = "residul"',
            "methods[1] ('b'): unknown memory 'residul'. Did you mean 'residual'? Valid names: ",
        ),
        (
            'compressor = "topk"\ncommunicator = "allgathr"',
            "methods[1] ('b'): unknown communicator 'allgathr'. Did you mean 'allgather'? Valid names: ",
        ),
        (
            'compressor = "topk"\nparams = {compres_ratio = 0.1}',
            "methods[1] ('b') on 2 workers: unknown parameter 'compres_ratio'. Did you mean 'compress_ratio'? "
            "Accepted parameters: compressor 'topk': compress_ratio;",
        ),
        (
            'compressor = "../user/my_methods.py:SignTopk"',
            "methods[1] ('b'): compressor '{file}:SignTopk': {file} has no 'SignTopk' (did you mean 'SignTopK'?)",
        ),
        (
            'compressor = "../user/my_workload.py:make"',
            "methods[1] ('b'): compressor '{folder}/my_workload.py:make' is a function, not a class derived from "
            "grace_dgc.Compressor",
        ),
        (
            'compressor = "topk"\nmemory = "../user/my_methods.py:SignTopK"',
            "methods[1] ('b'): memory '{file}:SignTopK' is SignTopK, not a class derived from grace_dgc.Memory",
        ),
        (
            'compressor = "../user/missing.py:SignTopK"',
            "methods[1] ('b'): compressor '{folder}/missing.py:SignTopK': the file {folder}/missing.py does not exist",
        ),
    ],
)
def test_a_misspelt_part_or_parameter_names_its_place_and_the_closest_name(user, tmp_path, method, expected):
    """Compressor, memory and communicator alike: the method's place in the config (and its
    label), then the error with the closest name; a spec's error names the file and the class."""
    toml = write_config(
        tmp_path, f'[[methods]]\nlabel = "a"\ncompressor = "none"\n[[methods]]\nlabel = "b"\n{method}\n'
    )
    with pytest.raises(GraceConfigError) as error:
        cfg.load_config(toml)
    assert str(error.value).startswith(expected.format(file=user / "my_methods.py", folder=user)), str(error.value)


def test_the_reports_methods_table_shows_a_plugins_file_by_name_not_its_absolute_path():
    from grace_survey.report.grouping import Group
    from grace_survey.report.tables import methods_table

    group = Group("mine", 2, "local")
    spec = "/home/someone/project/my_methods.py:SignTopK"
    group.runs.append({"compressor": spec, "memory": "residual", "communicator": "pkg.comms:Ring", "params": {"k": 3}})
    table = methods_table([group])
    assert "| mine | my_methods.py:SignTopK | residual | pkg.comms:Ring | k=3 |" in table
    assert "/home/someone" not in table
