"""Script mode through Hugging Face Accelerate: the cell's method attached after ``prepare``,
and one call per epoch that reports to the survey and to Accelerate's trackers.

    from grace_survey.script.accelerate import survey_attach, survey_log

    model, optimizer = accelerator.prepare(model, optimizer)
    survey_attach(accelerator, model, "topk", "residual", "allgather", optimizer=optimizer, compress_ratio=0.01)
    ...
    survey_log(accelerator, epoch, accuracy=accuracy, loss=loss)       # every process, once per epoch

``examples/survey_accelerate.py`` is a whole script.
"""

from __future__ import annotations

from typing import Any

import torch

from grace_dgc.training.integrations import logged_stats, own_group
from grace_dgc.training.integrations.accelerate import GraceAccelerate, attach
from grace_survey.script.api import cell_grace, report_metrics

_attached: list[GraceAccelerate] = []  # the last survey_attach's, for survey_log's grace statistics


def survey_attach(
    accelerator: Any,
    model: torch.nn.Module,
    compressor: str = "none",
    memory: str = "none",
    communicator: str = "allreduce",
    *,
    optimizer: Any = None,
    **params: Any,
) -> GraceAccelerate:
    """:func:`grace_dgc.training.integrations.accelerate.attach` with the cell's method (:func:`cell_grace`,
    on a process group of its own); run alone, the method given."""

    def made() -> Any:
        group = own_group() if accelerator.num_processes > 1 else None
        return cell_grace(compressor, memory, communicator, process_group=group, **params)

    attached = attach(accelerator, model, optimizer=optimizer, grace=made)
    _attached[:] = [attached]
    return attached


def survey_log(accelerator: Any, epoch: int, **metrics: float) -> None:
    """Once per epoch on every process: :func:`report_metrics` (``accuracy``, ``loss``,
    ``train_loss`` …) and the same metrics with ``grace/<stat>`` to ``accelerator.log``."""
    report_metrics(epoch=epoch, **metrics)
    stats = logged_stats(_attached[-1].stats()) if _attached else {}
    accelerator.log({**metrics, **stats}, step=epoch)
