"""Deprecated alias of :mod:`grace_survey`, kept for one release.

The survey moved to its own import package, ``grace_survey``, in the same distribution (the
library stays free of the app built on it). ``import grace_dgc.survey as survey`` and imports
of its old modules (``grace_dgc.survey.workloads``, ``.script``, ``.report`` …) still work and
give the new modules themselves, with one :class:`DeprecationWarning`. Write instead::

    import grace_survey as survey              # cell_grace, report_metrics, Workload, ...
    from grace_survey.workloads.registry import register_workload
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

from grace_survey import *  # noqa: F403  (the public API, under its old name)
from grace_survey import __all__  # noqa: F401

#: the old module (below ``grace_dgc.survey``) -> where it lives now
MOVED = {
    "cell": "grace_survey.config.cell",
    "conditions": "grace_survey.report.conditions",
    "config": "grace_survey.config.settings",
    "context": "grace_survey.running.context",
    "contract": "grace_survey.workloads.contract",
    "data": "grace_survey.workloads.data",
    "datasets": "grace_survey.workloads.datasets",
    "execute": "grace_survey.running.execute",
    "extras": "grace_survey.extras",
    "grid": "grace_survey.running.grid",
    "metrics": "grace_survey.running.metrics",
    "models": "grace_survey.workloads.models",
    "presets": "grace_survey.config.presets",
    "project": "grace_survey.projection.project",
    "report": "grace_survey.report",
    "results": "grace_survey.running.results",
    "schema": "grace_survey.config.schema",
    "script": "grace_survey.script",
    "text": "grace_survey.workloads.text",
    "train": "grace_survey.running.train",
    "tuning": "grace_survey.running.tuning",
    "units": "grace_survey.units",
    "workloads": "grace_survey.workloads",
}
# cli, netem and runner stay files here: ``python -m grace_dgc.survey.runner`` needs code to run

warnings.warn(
    "grace_dgc.survey moved to grace_survey (same API, same distribution) and this alias goes in the next "
    "release: write `import grace_survey as survey`",
    DeprecationWarning,
    stacklevel=2,
)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``grace_dgc.survey.<old>`` as the moved module itself (one object, not a copy)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix = __name__ + "."
        if fullname.startswith(prefix) and fullname[len(prefix) :] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name[len(__name__) + 1 :]])
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the real module: give it its own back
        module.__spec__ = self._own_specs[module.__name__]


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
