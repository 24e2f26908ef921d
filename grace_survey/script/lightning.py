"""Script mode through PyTorch Lightning: the cell's method as the trainer's strategy, and the
epoch's metrics reported by a callback, on every rank.

    from grace_survey.script.lightning import SurveyReporter, survey_strategy

    trainer = lightning.pytorch.Trainer(
        strategy=survey_strategy("topk", "residual", "allgather", compress_ratio=0.01),  # alone: this method
        callbacks=[SurveyReporter(accuracy="val_accuracy", loss="val_loss")],
    )

``examples/survey_lightning.py`` is a whole script.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from grace_dgc.training.integrations import own_group
from grace_dgc.training.integrations.lightning import GraceDDPStrategy
from grace_survey.script.api import cell_grace, report_metrics


def survey_strategy(
    compressor: str = "none", memory: str = "none", communicator: str = "allreduce", **params: Any
) -> GraceDDPStrategy:
    """A :class:`GraceDDPStrategy` whose Grace is the cell's method (:func:`cell_grace`, on a
    process group of its own); run alone, the method given."""
    return GraceDDPStrategy(
        grace=lambda: cell_grace(compressor, memory, communicator, process_group=own_group(), **params)
    )


class SurveyReporter(pl.Callback):
    """After each training epoch's validation (never the sanity check): :func:`report_metrics`
    with the trainer's logged metrics, named here (``accuracy``/``loss``: the test metric and
    loss the report ranks; a name not logged is left out)."""

    def __init__(
        self, accuracy: str = "val_accuracy", loss: str = "val_loss", train_loss: str | None = "train_loss"
    ) -> None:
        self.names = {"accuracy": accuracy, "loss": loss, "train_loss": train_loss}

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        logged = trainer.callback_metrics
        metrics = {key: float(logged[name]) for key, name in self.names.items() if name and name in logged}
        report_metrics(epoch=trainer.current_epoch + 1, **metrics)
