"""Survey workloads: the contract (:mod:`~grace_survey.workloads.contract`), the registry of
names and ``module:factory`` specs (:mod:`~grace_survey.workloads.registry`), the built-ins
(:mod:`~grace_survey.workloads.builtin`), their data, datasets and models, and the text workload.

Every public name of the single module the workloads once were is here (and still in
:mod:`grace_survey.workloads.registry`)."""

from grace_survey.workloads import registry as _registry
from grace_survey.workloads.registry import *  # noqa: F403  (the registry module's names are the package's)

__all__ = list(_registry.__all__)
