"""What the spilling tests share: a fit of a model on the tests' token data (under any strategy), its per-step losses,
the comparison of two models' weights, and the fit of an MLP (`lightning_varuna.demos.MLP`) on random data."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint
from models import TinyLM, token_dataset
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import SpillingStrategy

# Budgets that cut TinyLM with dropout (5 segments, batches of 8) into 1, 3 and 5 shards (at 5, one segment each).
# It needs 119 KB whole (103 KB without dropout): a budget of that or more runs it whole, and between 111 KB and
# 119 KB it is cut into 3 shards of two segments or one. 85KB cuts TinyLM without dropout into 5 shards too.
BUDGETS = {1: "1GB", 3: "115KB", 5: "85KB"}


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        if outputs:  # none: the step skipped the batch
            self.losses.append(float(outputs["loss"]))


def fit(
    model: L.LightningModule,
    strategy: Any,
    ckpt_path: str | None = None,
    loader: DataLoader | None = None,
    **kwargs: Any,
) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": 4,
        "gradient_clip_val": 0.5,
        "accumulate_grad_batches": 2,
        "limit_val_batches": 2,
        "val_check_interval": 4,
    }
    callbacks = [StepLosses(), *kwargs.pop("callbacks", [])]
    trainer = L.Trainer(
        devices=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **{**options, **kwargs},
    )
    data = token_dataset(64)
    loader = loader or DataLoader(data, batch_size=8)
    trainer.fit(model, loader, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer


def losses(trainer: L.Trainer) -> list[float]:
    return next(c for c in trainer.callbacks if isinstance(c, StepLosses)).losses  # type: ignore[attr-defined]


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


class LossScales(L.Callback):
    """The fp16 grad scaler's scale after each training batch."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]


class FrozenEmbeddingLM(TinyLM):
    """TinyLM whose optimizer holds only the parameters that need a gradient (as with a frozen backbone)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:  # the trainable parameters only
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


# The demo MLP the memory tests train: 24 layers of 1 MiB of parameters, 96 MiB with gradients and AdamW's moments.
WIDTH, LAYERS = 512, 24


def fit_mlp(
    model: L.LightningModule,
    strategy: SpillingStrategy,
    max_steps: int,
    width: int = WIDTH,
    rows: int = 192,
    callbacks: list[L.Callback] | None = None,
    accelerator: str = "cpu",
    batch_size: int = 32,
) -> L.Trainer:
    """Train an MLP of ``width`` on random regression data, with only ``callbacks`` around it."""
    data = TensorDataset(torch.randn(rows, width), torch.randn(rows, width))
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(data, batch_size=batch_size))
    return trainer


def memory_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak resident memory) and RssAnon of this process, in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM", "RssAnon")}
