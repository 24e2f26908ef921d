"""The comparative survey: workloads, runner, metrics and reports (``grace-dgc survey``).

What a user's code calls, in one place:

* a workload of your own: :class:`Workload`, :func:`register_workload` (or the
  ``grace_dgc.workloads`` entry point, or ``workload = "module:factory"`` in a TOML);
* script mode (``grace-dgc survey --script train.py``): :func:`cell_grace`,
  :func:`cell_seed`, :func:`report_metrics` and :func:`cell` in your script.
"""

from grace_survey.script.api import cell, cell_grace, cell_seed, report_metrics
from grace_survey.workloads.registry import Workload, get_workload, list_workloads, register_workload

__all__ = [
    "Workload",
    "cell",
    "cell_grace",
    "cell_seed",
    "get_workload",
    "list_workloads",
    "register_workload",
    "report_metrics",
]
