"""A user's own workload: the public Workload contract, the three ways to name one (decorator,
the ``grace_dgc.workloads`` entry point, ``module:factory`` / ``file.py:factory`` in a TOML),
streamed Datasets (the same batches as tensors, each rank reading its shard) and the errors
for a bad plugin. The multi-rank tests run real 2-rank gloo surveys."""

import json
import math
import textwrap

import pytest
import torch

from grace_dgc.errors import GraceConfigError
from grace_survey import Workload, get_workload, list_workloads, register_workload, report
from grace_survey.config import settings as cfg
from grace_survey.projection import project
from grace_survey.running import runner
from grace_survey.running.results import read_records
from grace_survey.running.train import objective
from grace_survey.workloads import data
from grace_survey.workloads import registry as wl

# a user's workload module: a teacher task held as tensors, or streamed from a Dataset that
# logs which examples each process read (to check that a rank reads only its shard)
PLUGIN = textwrap.dedent(
    """
    import os
    import torch
    from grace_survey import Workload

    def _data(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 12, generator=g)
        return x, (x[:, :3].sum(1) > 0).long()

    class Logged(torch.utils.data.Dataset):
        def __init__(self, x, y, log):
            self.x, self.y, self.log = x, y, log
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            if self.log:
                with open(f"{self.log}.{os.environ.get('RANK', 'parent')}", "a") as f:
                    f.write(f"{i}\\n")
            return self.x[i], self.y[i]

    def make(data_dir=None, seed=0, streamed=False, log="", n=384, workers=0):
        x, y = _data(n, 7)
        xt, yt = _data(128, 8)
        train = Logged(x, y, log) if streamed else (x, y)
        test = Logged(xt, yt, "") if streamed else (xt, yt)
        return Workload(
            train=train, test=test,
            make_model=lambda: torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
            batch_size=16, lr=0.1, epochs=2, target_accuracy=0.6, description="teacher task", loader_workers=workers,
        )

    def returns_wrong_type(data_dir=None, seed=0):
        return {"train": None}
    """
)

METHODS = [
    {"label": "dense", "compressor": "none"},
    {"label": "topk", "compressor": "topk", "memory": "residual", "communicator": "allgather",
     "params": {"compress_ratio": 0.1}},
]  # fmt: skip


@pytest.fixture
def fresh_registry(monkeypatch):
    """The workload registry as it is, restored after the test (what it registers is forgotten)."""
    for attribute in ("_entries", "_aliases", "broken"):
        monkeypatch.setattr(wl.WORKLOADS, attribute, dict(getattr(wl.WORKLOADS, attribute)))
    monkeypatch.setattr(wl.WORKLOADS, "_plugins_loaded", wl.WORKLOADS._plugins_loaded)
    return wl.WORKLOADS


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """``my_workloads.py`` in a folder on sys.path (spawned ranks inherit it)."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "my_workloads.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(folder))
    return folder


def _survey(raw, out, source="<config>"):
    conf = cfg.SurveyConfig(raw, source=source)
    summaries, failures = runner.run_grid(conf, str(out), progress=False, log=lambda *a: None)
    assert not failures, failures
    return summaries


# -- the contract -------------------------------------------------------------------------------
def test_register_workload_decorator_builds_through_get_workload(fresh_registry):
    @register_workload("Tiny-Teacher")
    def tiny(seed: int, width: int = 4) -> Workload:  # no data_dir: the contract lets it leave it out
        x = torch.randn(64, width, generator=torch.Generator().manual_seed(seed))
        return Workload(train=(x, x[:, 0].gt(0).long()), test=(x[:8], x[:8, 0].gt(0).long()),
                        make_model=lambda: torch.nn.Linear(width, 2))  # fmt: skip

    assert "tiny-teacher" in list_workloads("tiny-*")
    w = get_workload("TINY-teacher", seed=3, width=6, lr=0.2, train_samples=40)
    assert w.name == "tiny-teacher" and w.parameters == 6 * 2 + 2 and w.lr == 0.2
    assert data.size(w.train) == 40 and w.info["train_size"] == 40 and w.metric_name == "accuracy"
    with pytest.raises(GraceConfigError, match="does not accept colour; accepted: .*width"):
        get_workload("tiny-teacher", colour=1)
    with pytest.raises(GraceConfigError, match="already taken"):
        register_workload("tiny-teacher")(lambda seed: None)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"train": [1, 2, 3]}, r"train is a list; give \(inputs, targets\) tensors"),
        ({"train": (torch.zeros(4, 2), torch.zeros(3))}, "same number of rows"),
        ({"make_model": 3}, "make_model must be a function"),
        ({"loss": "mse"}, "loss = 'mse'; accepted: cross_entropy, lm or a function"),
        ({"metric": "f1"}, "metric must be a function"),
        ({"lr": -1.0}, "lr=-1.0 is out of range"),
        ({"target_accuracy": 85}, "target_accuracy=85 is out of range"),
        ({"loader_workers": -1}, "loader_workers=-1 is out of range"),
    ],
)
def test_contract_errors_say_what_was_wrong_and_what_is_accepted(fresh_registry, fields, message):
    x = torch.zeros(8, 2)
    base = {"train": (x, torch.zeros(8, dtype=torch.long)), "test": (x, torch.zeros(8, dtype=torch.long)),
            "make_model": lambda: torch.nn.Linear(2, 2)}  # fmt: skip
    register_workload("bad")(lambda: Workload(**dict(base, **fields)))
    with pytest.raises(GraceConfigError, match=message):
        get_workload("bad")


def test_module_and_file_specs_import_with_clear_errors(plugin_dir, tmp_path):
    w = get_workload("my_workloads:make", seed=0, n=100)
    assert w.name == "my_workloads:make" and data.size(w.train) == 100
    path = str(plugin_dir / "my_workloads.py")
    assert get_workload(f"{path}:make").parameters == 12 * 16 + 16 + 16 * 2 + 2
    with pytest.raises(GraceConfigError, match=r"has no 'mkae' \(did you mean 'make'\?\)"):
        get_workload("my_workloads:mkae")
    with pytest.raises(GraceConfigError, match="importing no_such_module failed: ModuleNotFoundError"):
        get_workload("no_such_module:make")
    with pytest.raises(GraceConfigError, match="does not exist"):
        get_workload(str(tmp_path / "missing.py") + ":make")
    with pytest.raises(GraceConfigError, match="returned a dict; a workload factory returns"):
        get_workload("my_workloads:returns_wrong_type")
    (plugin_dir / "broken_mod.py").write_text("import numpy\nraise RuntimeError('the data folder is not mounted')\n")
    with pytest.raises(GraceConfigError, match="importing broken_mod failed: RuntimeError: the data folder"):
        get_workload("broken_mod:make")


def test_entry_point_workloads_register_and_a_broken_one_is_named(plugin_dir, tmp_path, monkeypatch, fresh_registry):
    from conftest import install_dummy_distribution

    install_dummy_distribution(
        tmp_path,
        monkeypatch,
        "my-workloads",
        "[grace_dgc.workloads]\nmy-teacher = my_workloads:make\nbroken-net = no_such_module:make\n"
        "digits-mlp = my_workloads:make\n",
    )
    monkeypatch.setattr(fresh_registry, "_plugins_loaded", False)
    with pytest.warns(UserWarning) as warned:
        names = list_workloads()
    messages = " ".join(str(w.message) for w in warned)
    assert "broken-net" in messages and "'digits-mlp' (my_workloads:make, from my-workloads) is not loaded" in messages
    assert "my-teacher" in names and "mnist1d-mlp" in names and "broken-net" not in names
    assert get_workload("my-teacher").description.startswith("teacher task")
    from grace_dgc.cli import workloads_table

    assert "my-teacher        my_workloads:make" in workloads_table()
    with pytest.raises(GraceConfigError, match=r"plugin 'broken-net' \(no_such_module:make, from my-workloads\)"):
        get_workload("broken-net")


def test_a_plugin_naming_a_built_in_itself_is_no_clash_and_a_non_callable_one_is_named(
    plugin_dir, tmp_path, monkeypatch, fresh_registry
):
    """The one Registry's rules (issue 41): the same factory declared again loads silently, a
    plugin that is not a factory is remembered as broken, by name."""
    import warnings

    from conftest import install_dummy_distribution

    (plugin_dir / "not_a_factory.py").write_text("WIDTH = 3\n")
    install_dummy_distribution(
        tmp_path,
        monkeypatch,
        "more-workloads",
        "[grace_dgc.workloads]\nmnist1d-mlp = grace_survey.workloads.builtin:_mnist1d_mlp\n"
        "width = not_a_factory:WIDTH\n",
    )
    monkeypatch.setattr(fresh_registry, "_plugins_loaded", False)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        names = list_workloads()
    assert [str(w.message) for w in warned] == [
        "grace_dgc: the workload plugin 'width' (not_a_factory:WIDTH, from more-workloads) could not be registered: "
        "GraceConfigError: workload 'width': the factory must be callable, got 3; the other workloads work"
    ]
    assert "mnist1d-mlp" in names and "width" not in names
    with pytest.raises(GraceConfigError, match=r"plugin 'width' \(not_a_factory:WIDTH.*must be callable"):
        get_workload("width")


# -- metric and loss functions --------------------------------------------------------------------
def test_custom_loss_and_metric_and_their_errors():
    x = torch.zeros(4, 3)

    def make(**fields):
        return Workload(train=(x, x[:, 0]), test=(x, x[:, 0]), make_model=lambda: torch.nn.Linear(3, 3), **fields)

    output = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0], [0.0, 0.0, 1.0]])
    targets = torch.tensor([0, 1, 1, 2])
    top2 = make(metric=lambda out, y: ((out.topk(2, dim=1).indices == y[:, None]).any(1).sum(), len(y)))
    loss, total, count = objective(top2)(output, targets)
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(output, targets).item())
    assert (float(total), count) == (3.0, 4)  # row 2's target (1) is its lowest score: not in its top 2
    l1 = make(loss=lambda out, y: (out[:, 0] - y).abs().mean())
    assert objective(l1)(output, targets.float())[0].item() == pytest.approx((output[:, 0] - targets).abs().mean())
    with pytest.raises(GraceConfigError, match="metric.* returned str 'good'.*must return"):
        objective(make(metric=lambda out, y: "good"))(output, targets)
    with pytest.raises(GraceConfigError, match=r"returned tuple \(nan, 4\).*finite"):
        objective(make(metric=lambda out, y: (math.nan, 4)))(output, targets)
    with pytest.raises(GraceConfigError, match="loss.* returned float 0.5.*one-element floating tensor"):
        objective(make(loss=lambda out, y: 0.5))(output, targets)


# -- streamed data ---------------------------------------------------------------------------------
def test_batches_of_a_dataset_equal_the_tensor_rows():
    x, y = torch.randn(50, 3), torch.arange(50)
    index = [torch.tensor([4, 9, 1]), torch.tensor([0]), torch.tensor([49, 2])]
    dataset = torch.utils.data.TensorDataset(x, y)
    for (a, b), (c, d) in zip(data.batches((x, y), index), data.batches(dataset, index), strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    part = data.subset(dataset, torch.tensor([5, 7]))
    assert data.size(part) == 2 and torch.equal(part[1][0], x[7])


def test_a_streamed_workload_trains_exactly_as_its_tensors_and_each_rank_reads_its_shard(plugin_dir, tmp_path):
    """Fairness with a DataLoader: same initial weights, same batches in the same order, so the
    streamed run's every epoch equals the in-memory run's bit for bit."""
    log = tmp_path / "reads"
    base = {"workers": 2, "seeds": [0], "methods": METHODS[1:], "eval_batch_size": 64}
    tensors = _survey(dict(base, workload="my_workloads:make"), tmp_path / "tensors")
    streamed = _survey(
        # two DataLoader worker processes per rank (the ranks are not daemonic, so they may have children)
        dict(base, workload="my_workloads:make", workload_options={"streamed": True, "log": str(log), "workers": 2}),
        tmp_path / "streamed",
    )
    epochs = [[r for r in read_records(str(tmp_path / d)) if r["type"] == "epoch"] for d in ("tensors", "streamed")]
    keys = ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "bytes_per_step")
    assert [[e[k] for k in keys] for e in epochs[0]] == [[e[k] for k in keys] for e in epochs[1]]
    assert tensors[0]["final_test_accuracy"] == streamed[0]["final_test_accuracy"]
    reads = [[int(i) for i in open(f"{log}.{rank}").read().split()] for rank in (0, 1)]
    assert reads[0][0] == reads[1][0] == 0  # get_workload checks that item 0 is a pair: not a training read
    reads = [r[1:] for r in reads]
    # 384 examples, 16 per rank and step: 12 steps per epoch, 2 epochs, each read once per epoch
    assert len(reads[0]) == len(reads[1]) == 2 * 12 * 16
    for epoch in range(2):
        mine = [set(r[epoch * 192 : (epoch + 1) * 192]) for r in reads]
        assert not mine[0] & mine[1] and len(mine[0] | mine[1]) == 384  # disjoint shards covering the split


# -- through the survey, report and projection -------------------------------------------------------
def test_a_toml_file_spec_runs_through_survey_report_and_projection(plugin_dir, tmp_path):
    toml = tmp_path / "conf" / "survey.toml"
    toml.parent.mkdir()
    toml.write_text(
        textwrap.dedent(
            """
            name = "mine"
            workload = "../user/my_workloads.py:make"
            workers = 2
            seeds = [0, 1]
            [[methods]]
            label = "dense"
            compressor = "none"
            """
        )
    )
    conf = cfg.load_config(str(toml))
    assert conf.workload == f"{plugin_dir / 'my_workloads.py'}:make"  # relative to the TOML, made absolute
    out = tmp_path / "out"
    summaries, failures = runner.run_grid(conf, str(out), progress=False, log=lambda *a: None)
    assert not failures and len(summaries) == 2
    first = summaries[0]
    assert first["workload"] == "my_workloads.py:make" and first["metric"] == "accuracy"  # no absolute path
    assert first["dense_bytes_per_step"] == 4 * (12 * 16 + 16 + 16 * 2 + 2)
    with open(out / "survey_config.json") as f:  # a saved config reloads from anywhere
        assert cfg.SurveyConfig(json.load(f)).workload == conf.workload
    path = report.write_report(str(out))
    assert "mine" in open(path).read()
    assert project.main([str(out), "--nodes", "8", "--bandwidth", "1gbit"]) == 0
