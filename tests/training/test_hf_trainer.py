"""grace_dgc inside the Hugging Face ``Trainer`` (issue 44): ``attach`` on 2 gloo ranks with the
real package, every case in the same two processes:

* ``none``: the parameters after N steps equal the plain Trainer's bit for bit;
* top-k + residual: ranks bitwise in sync; resuming from the Trainer's own checkpoint half-way
  (``grace_dgc.pt`` beside its files) equals the uninterrupted run bit for bit;
* ``gradient_accumulation_steps=2`` exchanges once per optimizer step; ``grace/<stat>`` in the
  Trainer's logs; a resume with no grace state, or another method's, is refused by name.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from ranks import run_ranks
from trainer_checks import (
    assert_a_dense_checkpoint_is_warned_of_and_trained_on,
    assert_in_sync_and_resumed_bit_for_bit,
    assert_none_is_the_trainers_own_ddp,
    assert_refused_naming,
    counts,
    grace_warnings,
)

from grace_dgc.errors import GraceConfigError

WORLD, STEPS = 2, 6


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def _data():
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(6, generator=g), "y": torch.randn(3, generator=g)} for _ in range(8 * STEPS * WORLD)]


def _train(directory, method=None, accumulate=1, resume=None, steps=STEPS):
    from transformers import Trainer, TrainingArguments

    from grace_dgc.training.integrations.hf_trainer import attach

    args = TrainingArguments(
        output_dir=directory,
        per_device_train_batch_size=8 // accumulate,
        gradient_accumulation_steps=accumulate,
        max_steps=steps,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=STEPS // 2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    model = Regression()
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    callback = attach(trainer, **method) if method is not None else None
    trainer.train(resume_from_checkpoint=resume)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, trainer, callback


def trainer_job(rank, world_size, directory):
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    out = {}
    out["plain"], _, _ = _train(os.path.join(directory, "plain"))
    out["none"], _, _ = _train(os.path.join(directory, "none"), {})
    topk = dict(compressor="topk", memory="residual", communicator="allgather", compress_ratio=0.3)
    out["topk"], trainer, callback = _train(os.path.join(directory, "topk"), topk)
    out["steps"], out["topk_counts"] = callback.grace.stats()["steps"], counts(callback.grace)
    out["logged"] = [entry for entry in trainer.state.log_history if "grace/steps" in entry][-1]
    out["resumed"], _, callback = _train(os.path.join(directory, "topk"), topk, resume=True)
    out["resumed_counts"] = counts(callback.grace)
    _, _, callback = _train(os.path.join(directory, "accumulated"), topk, accumulate=2)
    out["accumulated_steps"] = callback.grace.stats()["steps"]
    try:
        _train(
            os.path.join(directory, "refused"),
            {**topk, "compressor": "randomk"},
            resume=os.path.join(directory, "topk", "checkpoint-3"),
        )
        out["refused_method"] = None
    except GraceConfigError as error:
        out["refused_method"] = str(error)
    with grace_warnings() as messages:  # the plain run's checkpoint: no grace_dgc.pt
        _, _, callback = _train(
            os.path.join(directory, "dense"), topk, resume=os.path.join(directory, "plain", "checkpoint-3")
        )
    out["dense_resume"], out["dense_resume_steps"] = list(messages), callback.grace.stats()["steps"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(trainer_job, WORLD, args=(str(tmp_path_factory.mktemp("trainer")),), timeout=600)


@pytest.mark.fast
def test_none_equals_the_plain_trainer_bit_for_bit(results):
    assert_none_is_the_trainers_own_ddp(results, "plain")


@pytest.mark.fast
def test_topk_ranks_in_sync_and_resume_equals_the_uninterrupted_run(results):
    assert_in_sync_and_resumed_bit_for_bit(results, "plain")


def test_accumulation_exchanges_once_per_optimizer_step_and_stats_reach_the_logs(results):
    assert results[0]["steps"] == STEPS
    assert results[0]["accumulated_steps"] == STEPS
    logged = results[0]["logged"]
    assert logged["grace/steps"] >= 1 and 0 < logged["grace/compression_ratio"] < 1


def test_a_resume_of_another_method_is_refused_by_name_and_a_dense_one_warned_of(results):
    assert_refused_naming(results, "refused_method", "randomk")
    assert_a_dense_checkpoint_is_warned_of_and_trained_on(results)
