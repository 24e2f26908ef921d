"""grace_dgc inside Hugging Face Accelerate (issue 44): ``attach`` after ``prepare`` on 2 gloo
ranks with the real package, every case in the same two processes:

* ``none``: the parameters after N steps equal Accelerate's own DDP bit for bit;
* top-k + residual: ranks bitwise in sync; ``save_state`` half-way, then a fresh model,
  optimizer and ``load_state`` equals the uninterrupted run bit for bit (the residual travels
  in the main process's file, gathered from every rank);
* ``accelerator.accumulate`` with 2 micro-batches exchanges once per optimizer step;
* ``log_stats`` reaches the trackers; another method's state is refused by name.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("accelerate")

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


def _batches(rank, steps=STEPS):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


def _prepared(accelerator):
    """A fresh case: Accelerate keeps every prepared object (and saves them all), so forget the
    previous case's first (``free_memory``; the registered grace objects with them)."""
    accelerator.free_memory()
    accelerator._custom_objects.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return accelerator.prepare(model, optimizer)


def _train(accelerator, model, optimizer, batches):
    for x, y in batches:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class Tracker:
    """An Accelerate tracker that keeps what it is given."""

    name, requires_logging_directory, main_process_only = "memory", False, False

    def __init__(self):
        self.logged = []

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.logged.append(dict(values))

    def finish(self):
        pass


def accelerate_job(rank, world_size, directory):
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    from grace_dgc.training.integrations.accelerate import attach

    warnings.filterwarnings("ignore")
    tracker = type("MemoryTracker", (Tracker, GeneralTracker), {})()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("grace")
    batches, out = _batches(rank), {}
    model, optimizer = _prepared(accelerator)
    _train(accelerator, model, optimizer, batches[: STEPS // 2])
    accelerator.save_state(os.path.join(directory, "dense"))  # a dense run's checkpoint: no grace_dgc.pt
    _train(accelerator, model, optimizer, batches[STEPS // 2 :])
    out["ddp"] = _flat(model)
    model, optimizer = _prepared(accelerator)
    attach(accelerator, model, optimizer=optimizer)
    _train(accelerator, model, optimizer, batches)
    out["none"] = _flat(model)

    topk = dict(compressor="topk", memory="residual", communicator="allgather", compress_ratio=0.3)
    model, optimizer = _prepared(accelerator)
    grace = attach(accelerator, model, optimizer=optimizer, **topk)
    _train(accelerator, model, optimizer, batches[: STEPS // 2])
    accelerator.save_state(os.path.join(directory, "half"))
    _train(accelerator, model, optimizer, batches[STEPS // 2 :])
    out["topk"], out["steps"], out["topk_counts"] = _flat(model), grace.stats()["steps"], counts(grace)
    grace.log_stats(step=STEPS)
    out["logged"] = tracker.logged[-1] if tracker.logged else None  # accelerator.log: the main process

    model, optimizer = _prepared(accelerator)
    resumed = attach(accelerator, model, optimizer=optimizer, **topk)
    accelerator.load_state(os.path.join(directory, "half"))
    _train(accelerator, model, optimizer, batches[STEPS // 2 :])
    out["resumed"], out["resumed_counts"] = _flat(model), counts(resumed)

    accelerator.gradient_accumulation_steps = 2
    model, optimizer = _prepared(accelerator)
    grace = attach(accelerator, model, optimizer=optimizer, **topk)
    _train(accelerator, model, optimizer, batches)
    out["accumulated_steps"] = grace.stats()["steps"]
    accelerator.gradient_accumulation_steps = 1

    model, optimizer = _prepared(accelerator)
    attach(accelerator, model, optimizer=optimizer, **{**topk, "compressor": "randomk"})
    try:
        accelerator.load_state(os.path.join(directory, "half"))
        out["refused"] = None
    except GraceConfigError as error:
        out["refused"] = str(error)

    model, optimizer = _prepared(accelerator)
    resumed = attach(accelerator, model, optimizer=optimizer, **topk)
    with grace_warnings() as messages:
        accelerator.load_state(os.path.join(directory, "dense"))
    _train(accelerator, model, optimizer, batches[STEPS // 2 :])
    out["dense_resume"], out["dense_resume_steps"] = list(messages), resumed.stats()["steps"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(accelerate_job, WORLD, args=(str(tmp_path_factory.mktemp("accelerate")),), timeout=600)


@pytest.mark.fast
def test_none_equals_accelerates_ddp_bit_for_bit(results):
    assert_none_is_the_trainers_own_ddp(results, "ddp")


@pytest.mark.fast
def test_topk_ranks_in_sync_and_resume_equals_the_uninterrupted_run(results):
    assert_in_sync_and_resumed_bit_for_bit(results, "ddp")


def test_accumulation_exchanges_once_per_optimizer_step_and_stats_reach_the_trackers(results):
    assert results[0]["steps"] == STEPS
    assert results[0]["accumulated_steps"] == STEPS // 2
    logged = results[0]["logged"]
    assert logged["grace/steps"] == STEPS and 0 < logged["grace/compression_ratio"] < 1


def test_another_methods_state_is_refused_by_name(results):
    assert_refused_naming(results, "refused", "randomk", "topk")


def test_a_dense_checkpoint_is_warned_of_and_trained_on(results):
    assert_a_dense_checkpoint_is_warned_of_and_trained_on(results)
