"""grace_dgc where users already train: PyTorch Lightning, Hugging Face Accelerate and the
Hugging Face Trainer.

Each integration is a module of its own, imported by name, so the library never needs these
packages (``pip install 'grace_dgc[integrations]'`` brings them, pinned in constraints.txt):

* :mod:`.lightning`: :class:`~grace_dgc.training.integrations.lightning.GraceDDPStrategy`, a DDP
  strategy by name, from Python or a LightningCLI YAML;
* :mod:`.accelerate`: :func:`~grace_dgc.training.integrations.accelerate.attach`, one call after
  ``accelerator.prepare``;
* :mod:`.hf_trainer`: :func:`~grace_dgc.training.integrations.hf_trainer.attach`, one call before
  ``trainer.train()``.

All three keep every rank's state (residuals, momenta, owner errors) and the counters of
:meth:`Grace.stats` in the trainer's own checkpoint (rank 0 writes it, gathered from every
rank by :func:`grace_dgc.gather_state`; each rank takes its own part back on resume), refuse
a resume that does not fit (another method, settings or world size) by name, and report
:meth:`Grace.stats` through the trainer's logging. One rule for a checkpoint that holds no
grace state (a dense run's, resumed with compression): every trainer says so in one warning
(:func:`warn_of_a_checkpoint_without_grace`) and trains on, grace's state starting empty, as
the DistributedOptimizer does; the model and optimizer resume as saved.
"""

from __future__ import annotations

from typing import Any

#: the statistics reported through a trainer's logger, under ``grace/<name>``
LOGGED = (
    "steps",
    "bytes_sent",
    "bytes_received",
    "dense_bytes",
    "compression_ratio",
    "bytes_per_step",
    "wait_seconds",
)


def warn_of_a_checkpoint_without_grace(grace: Any, where: str) -> None:
    """The one rule for a checkpoint with no grace state (a dense run's): say so, and train on
    with grace's state empty (error feedback, momenta and factors start at zero, as in a new
    run; the model and optimizer resume as saved)."""
    import logging

    logging.getLogger("grace_dgc").warning(
        "%s holds no grace_dgc state (a dense run's checkpoint, or one saved without grace_dgc attached): %r "
        "starts with its state empty (error feedback, momenta, factors) and its counters at 0; the model and "
        "optimizer resume as saved",
        where,
        grace,
    )


def own_group() -> Any:
    """A process group over every rank for grace alone (``new_group``: collective, so every rank
    calls it at the same point of its set-up). The trainer's own collectives during backward
    (DDP's used-parameter map with ``find_unused_parameters``, which the Trainer turns on for
    plain modules) and grace's, issued from its thread, then never compete for one order."""
    import torch.distributed as dist

    return dist.new_group()


def logged_stats(stats: dict[str, Any]) -> dict[str, float]:
    """The numbers of :meth:`Grace.stats` a trainer logs: :data:`LOGGED` and every phase's
    ``*_seconds``, as floats under ``grace/<name>``."""
    keys = [k for k in stats if k in LOGGED or k.endswith("_seconds")]
    return {f"grace/{k}": float(stats[k]) for k in keys if isinstance(stats[k], (int, float))}
