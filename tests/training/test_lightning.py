"""grace_dgc inside PyTorch Lightning (issue 44): ``GraceDDPStrategy`` on 2 gloo ranks with the
real package. One job runs every case in the same two processes (each case a fresh Trainer):

* ``none``: the parameters after two epochs equal Lightning's own DDPStrategy bit for bit;
* top-k + residual: ranks bitwise in sync; stop after one epoch → ``save_checkpoint`` →
  resume with ``fit(ckpt_path=...)`` equals the uninterrupted run bit for bit (the residual
  travels in rank 0's checkpoint, gathered from every rank);
* ``accumulate_grad_batches=2`` exchanges once per optimizer step;
* ``grace/<stat>`` reaches the logger;
* a checkpoint of another method is refused by name.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("lightning")

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

WORLD = 2
BATCHES = 4  # per rank and epoch


def _module():  # built in the rank processes: lightning is imported there
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            self.logged: list[dict[str, float]] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.logged.append(
                {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("grace/")}
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            data = torch.utils.data.TensorDataset(
                torch.randn(8 * BATCHES * WORLD, 6, generator=g), torch.randn(8 * BATCHES * WORLD, 3, generator=g)
            )
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)

    return Regression()


def _fit(strategy, epochs, ckpt_path=None, save=None, accumulate=1):
    import lightning.pytorch as pl

    module = _module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)  # every rank: the gather is a collective
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]), module, trainer


def lightning_job(rank, world_size, directory):
    import logging

    from lightning.pytorch.strategies import DDPStrategy

    from grace_dgc.training.integrations.lightning import GraceDDPStrategy

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    out = {}
    out["ddp"], _, _ = _fit(DDPStrategy(), 2)
    out["none"], _, _ = _fit(GraceDDPStrategy(), 2)
    topk = dict(compressor="topk", memory="residual", communicator="allgather", compress_ratio=0.3)
    out["topk"], module, trainer = _fit(GraceDDPStrategy(**topk), 2)
    out["logged"], out["first_logged"] = module.logged[-1], module.logged[0]
    out["steps"] = trainer.strategy.grace.stats()["steps"]
    out["topk_counts"] = counts(trainer.strategy.grace)
    path = os.path.join(directory, "half.ckpt")
    _fit(GraceDDPStrategy(**topk), 1, save=path)
    out["resumed"], _, trainer = _fit(GraceDDPStrategy(**topk), 2, ckpt_path=path)
    out["resumed_counts"] = counts(trainer.strategy.grace)
    _, _, trainer = _fit(GraceDDPStrategy(**topk), 1, accumulate=2)
    out["accumulated_steps"] = trainer.strategy.grace.stats()["steps"]
    try:
        _fit(GraceDDPStrategy("randomk", "residual", "allgather", compress_ratio=0.3), 2, ckpt_path=path)
        out["refused"] = None
    except GraceConfigError as error:
        out["refused"] = str(error)
    dense = os.path.join(directory, "dense.ckpt")
    _fit(DDPStrategy(), 1, save=dense)
    with grace_warnings() as messages:
        _, _, trainer = _fit(GraceDDPStrategy(**topk), 2, ckpt_path=dense)
    out["dense_resume"], out["dense_resume_steps"] = list(messages), trainer.strategy.grace.stats()["steps"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(lightning_job, WORLD, args=(str(tmp_path_factory.mktemp("lightning")),), timeout=600)


@pytest.mark.fast
def test_none_equals_lightnings_ddp_bit_for_bit(results):
    assert_none_is_the_trainers_own_ddp(results, "ddp")


@pytest.mark.fast
def test_topk_ranks_in_sync_and_resume_equals_the_uninterrupted_run(results):
    assert_in_sync_and_resumed_bit_for_bit(results, "ddp")


def test_accumulation_exchanges_once_per_optimizer_step_and_stats_are_logged(results):
    assert results[0]["steps"] == 2 * BATCHES
    assert results[0]["accumulated_steps"] == BATCHES // 2
    logged = results[0]["logged"]
    assert logged["grace/steps"] == 2 * BATCHES and 0 < logged["grace/compression_ratio"] < 1
    # each row counts its own step's exchange (it was one step late: the first row read zeros)
    assert results[0]["first_logged"]["grace/steps"] == 1 and results[0]["first_logged"]["grace/bytes_sent"] > 0
    assert logged["grace/bytes_sent"] > 0


def test_a_checkpoint_of_another_method_is_refused_by_name_and_a_dense_one_warned_of(results):
    assert_refused_naming(results, "refused", "randomk", "topk")
    assert_a_dense_checkpoint_is_warned_of_and_trained_on(results)


def test_the_strategy_refuses_a_second_hook_and_a_method_given_twice():
    from grace_dgc.training.integrations.lightning import GraceDDPStrategy

    with pytest.raises(GraceConfigError, match="ddp_comm_hook cannot be given"):
        GraceDDPStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(GraceConfigError, match="not both"):
        GraceDDPStrategy("topk", grace=lambda: None)


def test_lightning_cli_builds_the_strategy_from_its_class_path(tmp_path):
    """A LightningCLI YAML names the strategy by class path, the method by its init_args."""
    pytest.importorskip("jsonargparse")
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from grace_dgc.training.integrations.lightning import GraceDDPStrategy

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  strategy:\n"
        "    class_path: grace_dgc.training.integrations.lightning.GraceDDPStrategy\n"
        "    init_args:\n"
        "      compressor: topk\n"
        "      memory: residual\n"
        "      communicator: allgather\n"
        "      params: {compress_ratio: 0.01}\n"
    )

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

    cli = LightningCLI(Module, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, GraceDDPStrategy)
    assert strategy.method == ("topk", "residual", "allgather") and strategy.method_params == {"compress_ratio": 0.01}
