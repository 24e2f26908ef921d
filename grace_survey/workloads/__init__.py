"""Survey workloads: the contract (:mod:`~grace_survey.workloads.contract`), the registry of
names and ``module:factory`` specs (:mod:`~grace_survey.workloads.registry`), the built-ins
(:mod:`~grace_survey.workloads.builtin`), their data, datasets and models, and the text workload.

Every public name of the single module the workloads once were is here (and still in
:mod:`grace_survey.workloads.registry`)."""

from grace_survey.workloads.registry import (
    ENTRY_POINT_GROUP,
    FC_HEAVY_SIZES,
    HYPER_PARAMETERS,
    LOSSES,
    LR_SCHEDULES,
    MAX_EPOCHS,
    OPTIMIZERS,
    WORKLOADS,
    Factory,
    LossFn,
    MetricFn,
    MissingDataError,
    Split,
    Workload,
    check_split,
    get_workload,
    is_spec,
    list_workloads,
    parameter_count,
    register_workload,
    resolve_spec,
    size,
    workload_factory,
    workloads_table,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "FC_HEAVY_SIZES",
    "HYPER_PARAMETERS",
    "LOSSES",
    "LR_SCHEDULES",
    "MAX_EPOCHS",
    "OPTIMIZERS",
    "WORKLOADS",
    "Factory",
    "LossFn",
    "MetricFn",
    "MissingDataError",
    "Split",
    "Workload",
    "check_split",
    "get_workload",
    "is_spec",
    "list_workloads",
    "parameter_count",
    "register_workload",
    "resolve_spec",
    "size",
    "workload_factory",
    "workloads_table",
]
