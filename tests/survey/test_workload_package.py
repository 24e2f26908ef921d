"""The workloads' folder (issue 41): the registry (names, specs, plugins), the built-ins apart
(they do not import the registry that registers them), and the package giving every public name
of the single module the workloads once were."""

import ast
import pathlib

import grace_survey.workloads as package
from grace_survey.workloads import builtin, registry, text

# every public name of grace_survey.workloads.registry before the split (imports of other
# libraries left out)
OLD_NAMES = (
    "ENTRY_POINT_GROUP", "FC_HEAVY_SIZES", "HYPER_PARAMETERS", "LOSSES", "LR_SCHEDULES", "MAX_EPOCHS", "OPTIMIZERS",
    "Factory", "LossFn", "MetricFn", "MissingDataError", "Split", "Workload", "check_split", "get_workload",
    "is_spec", "list_workloads", "parameter_count", "register_workload", "resolve_spec", "size",
    "workload_factory", "workloads_table",
)  # fmt: skip


def test_the_package_and_the_registry_give_every_name_the_old_module_gave():
    for name in OLD_NAMES:
        assert getattr(package, name) is getattr(registry, name), name
    assert set(OLD_NAMES) <= set(package.__all__) == set(registry.__all__)


def test_the_built_ins_are_registered_as_they_are_defined():
    assert set(builtin.BUILTIN) == {
        "mnist1d-mlp", "mnist1d-cnn", "digits-mlp", "fc-heavy", "mnist-mlp", "mnist-lenet5", "cifar10-resnet20",
        "ptb-lstm", "pydoc-gpt",
    }  # fmt: skip
    for name, factory in builtin.BUILTIN.items():
        assert registry.workload_factory(name) == (name, factory)
    assert builtin.BUILTIN["pydoc-gpt"] is text.build_workload


def test_the_built_ins_do_not_import_the_registry():
    tree = ast.parse(pathlib.Path(builtin.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert "grace_survey.workloads.registry" not in imported and "registry" not in names
