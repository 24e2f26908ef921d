r"""A survey script trained by PyTorch Lightning: a small CNN on scikit-learn's digits, its
gradients compressed by grace_dgc through the strategy (no hook or report by hand).

    grace-dgc survey --script examples/survey_lightning.py --config examples/survey_script.toml \
        --out runs/lightning [--script-args --epochs 6]
    torchrun --nproc-per-node 2 examples/survey_lightning.py --epochs 3        # alone: top-k 1 % + residual

``survey_strategy`` gives Lightning the cell's method (alone: the one named here); ``SurveyReporter``
reports each epoch's validation metrics to the survey on every rank.
"""

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from survey_classifier import arguments, loaders, model

import grace_survey as survey
from grace_survey.script.lightning import SurveyReporter, survey_strategy


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net, self.lr = model(), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.log("val_loss", F.cross_entropy(out, y), sync_dist=True)
        self.log("val_accuracy", (out.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main():
    args = arguments(__doc__)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's (torchrun, the survey)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    seed = survey.cell_seed()
    torch.manual_seed(seed)  # the same initial weights on every rank and for every method
    net = Classifier(args.lr)
    shuffled, test = loaders(args.batch, seed)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=survey_strategy("topk", "residual", "allgather", compress_ratio=0.01),
        callbacks=[SurveyReporter(accuracy="val_accuracy", loss="val_loss", train_loss="train_loss")],
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(net, shuffled, test)
    if trainer.is_global_zero:
        print(f"test accuracy {float(trainer.callback_metrics['val_accuracy']):.3f}", flush=True)


if __name__ == "__main__":
    main()
