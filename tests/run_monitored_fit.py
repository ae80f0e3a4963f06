"""Train `TinyLM` with the callbacks that watch a validation metric, then test and predict from the best checkpoint:
``python run_monitored_fit.py OUT_DIR MODE``, MODE one of `STRATEGIES`. Writes ``OUT_DIR/result.json`` (rank 0)
with the step losses, the learning rate at each epoch's end, where `EarlyStopping` stopped, the checkpoints
`ModelCheckpoint` kept, the test metrics, the predictions and the spilled shards."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(__file__))
from models import RecordLosses, TinyLM, token_dataset  # noqa: E402

from lightning_varuna import SpillingStrategy, VarunaStrategy  # noqa: E402


class PlateauLM(TinyLM):
    """Halves its learning rate when ``val_loss`` improved by less than 70%, and has a test step."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, y = batch
        self.log("test_loss", F.cross_entropy(self(idx).flatten(0, 1), y.flatten()), sync_dist=True)


class EpochLearningRates(L.Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


STRATEGIES: dict[str, Callable[[], Strategy | str]] = {  # one device, 2 stages, 3 shards
    "one": lambda: "auto",
    "pipelined": lambda: VarunaStrategy(pipeline_parallel_size=2),
    "spilled": lambda: SpillingStrategy(memory_budget="95KB"),  # 3 shards of TinyLM
}


def main(out: str, mode: str) -> None:
    pipelined = mode == "pipelined"
    L.seed_everything(0)
    data, held_out = token_dataset(64), token_dataset(32, seed=2)
    sampler = None if pipelined else DistributedSampler(data, 1, 0, seed=0)  # VarunaStrategy's order on one device
    losses, rates = RecordLosses(), EpochLearningRates()
    best = ModelCheckpoint(os.path.join(out, "checkpoints"), "{epoch}-{val_loss:.4f}", monitor="val_loss", save_top_k=2)
    stop = EarlyStopping(monitor="val_loss", min_delta=0.001, patience=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2 if pipelined else 1,
        strategy=STRATEGIES[mode](),
        max_epochs=30, callbacks=[losses, rates, best, stop], logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    model = PlateauLM(lr=0.05)
    trainer.fit(model, DataLoader(data, batch_size=8, sampler=sampler), DataLoader(held_out, batch_size=8))
    shards = len(trainer.strategy.shards) if isinstance(trainer.strategy, SpillingStrategy) else None  # of the fit
    tested = trainer.test(model, DataLoader(held_out, batch_size=8), ckpt_path="best", verbose=False)
    predicted = trainer.predict(model, DataLoader(held_out, batch_size=8), ckpt_path="best")
    if trainer.global_rank == 0:
        result = {
            "losses": losses.losses,
            "rates": rates.rates,
            "stopped_epoch": stop.stopped_epoch,
            "best": os.path.basename(best.best_model_path),
            "kept": sorted(os.path.basename(path) for path in best.best_k_models),
            "tested": tested,
            "predicted": [p.tolist() for p in predicted],
            "shards": shards,
        }
        with open(os.path.join(out, "result.json"), "w") as file:
            json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
