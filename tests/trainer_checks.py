"""What the trainer integrations' tests assert of their jobs' results (tests/training/test_lightning.py,
test_accelerate.py, test_hf_trainer.py): per rank, the parameters after the trainer's own DDP run
(``reference``), after ``none``, after top-k + residual uninterrupted (``topk``) and resumed from the
trainer's checkpoint half-way (``resumed``), and the refusals' messages."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch


def assert_none_is_the_trainers_own_ddp(results: list[dict], reference: str) -> None:
    for rank in results:
        assert torch.equal(rank["none"], rank[reference])


def counts(grace) -> dict:
    """The counters a trainer logs that must add up over a resume (issue 53: they restarted at 0)."""
    stats = grace.stats()
    return {key: stats[key] for key in ("steps", "groups", "tensors", "bytes_sent", "dense_bytes")}


def assert_in_sync_and_resumed_bit_for_bit(results: list[dict], reference: str) -> None:
    assert torch.equal(results[0]["topk"], results[1]["topk"])
    assert not torch.equal(results[0]["topk"], results[0][reference])  # the method did act
    for rank in results:
        assert torch.equal(rank["resumed"], rank["topk"])
        # the resumed run's counters go on from the checkpoint's: they end where the uninterrupted run's do
        assert rank["resumed_counts"] == rank["topk_counts"], (rank["resumed_counts"], rank["topk_counts"])


def assert_refused_naming(results: list[dict], key: str, *named: str) -> None:
    for rank in results:
        assert rank[key] is not None and all(word in rank[key] for word in named), rank[key]


@contextmanager
def grace_warnings():
    """The messages grace_dgc logs inside the block (the integrations' warnings)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("grace_dgc")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def assert_a_dense_checkpoint_is_warned_of_and_trained_on(results: list[dict]) -> None:
    """The one rule of the three trainers (grace_dgc.training.integrations): a checkpoint without grace state
    resumes with one warning, grace's state empty, and training goes on."""
    for rank in results:
        warned = [m for m in rank["dense_resume"] if "holds no grace_dgc state" in m]
        assert len(warned) == 1 and "starts with its state empty" in warned[0], rank["dense_resume"]
        assert rank["dense_resume_steps"] > 0  # it trained on
