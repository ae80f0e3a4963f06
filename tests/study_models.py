"""The trials of the model selection tests: a small regression MLP whose layers and learning rate a trial suggests,
the same data for every trial, and a callback that keeps each step's loss in a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna.demos import MLP

WIDTH, ROWS, BATCH = 16, 96, 8
VAL_EVERY = 4  # steps between validations, each reported to the study


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ROWS, WIDTH, generator=generator), torch.randn(ROWS, WIDTH, generator=generator))


def regression_mlp(layers: int, lr: float, dropout: float = 0.0) -> MLP:
    """The trial's model, initialized the same way for the same parameters (a trial resumed elsewhere too); the
    seed also decides its dropout masks."""
    torch.manual_seed(layers)
    return MLP(WIDTH, layers, lr=lr, optimizer="sgd", dropout=dropout)


def trial_kwargs(trial: Any, max_steps: int, dropout: float = 0.0) -> dict[str, Any]:
    """What `MultiModelTrainer.add` takes for ``trial`` (its parameters suggested here)."""
    layers = trial.suggest_int("layers", 2, 5)
    lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
    return dict(model=regression_mlp(layers, lr, dropout), **fit_kwargs(max_steps))


def fit_kwargs(max_steps: int) -> dict[str, Any]:
    return dict(
        train_dataloaders=DataLoader(data(), batch_size=BATCH),
        val_dataloaders=DataLoader(data(), batch_size=32),
        max_steps=max_steps,
        val_check_interval=VAL_EVERY,
        logger=False,
        enable_checkpointing=False,
    )


def train_alone(
    layers: int, lr: float, max_steps: int, dropout: float = 0.0
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The trial trained alone with plain Lightning: each step's loss and the final weights."""
    model, kwargs = regression_mlp(layers, lr, dropout), fit_kwargs(max_steps)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
        ) -> None:
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=VAL_EVERY, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(model, kwargs["train_dataloaders"], kwargs["val_dataloaders"])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class LossLog(L.Callback):
    """Appends ``{"step": global step, "loss": loss}`` to ``path`` after each training step, written through."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")


def logged_losses(path: Path) -> dict[int, float]:
    """The losses a `LossLog` wrote, by global step (the last written for a step, after a resume)."""
    return {entry["step"]: entry["loss"] for entry in map(json.loads, path.read_text().splitlines())}
