"""A model built in `configure_model` under SpillingStrategy: built on the meta device, given memory and initial
values a segment at a time at set-up, then trained like plain training from the same start; a module without
`reset_parameters` and a metric built there are named with what to do."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torchmetrics
from models import DIM, VOCAB, Block, TinyLM
from spilled_runs import BUDGETS, assert_same_model, fit, losses
from torch import nn

from lightning_varuna import CutPoint, SpillingStrategy
from lightning_varuna.checkpoint.consolidate import consolidate


class BuiltInConfigureModel(TinyLM):
    """TinyLM whose layers are built in `configure_model`, as large models are (on the meta device there)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.lr, self.scheduler = 0.05, False
        self.acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro")
        self.val_f1 = torchmetrics.classification.MulticlassF1Score(VOCAB, average="macro")
        self.built_on: torch.device | None = None

    def configure_model(self) -> None:
        if self.built_on is not None:
            return
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(5))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.built_on = self.emb.weight.device


class SaveAtStart(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_a_model_built_in_configure_model_is_materialized_shard_by_shard(tmp_path, disk):
    """`configure_model` runs on the meta device; set-up gives each segment memory and its layers' initial values
    (`reset_parameters`) as it measures it, and spills it; training then matches plain training from the same
    initial weights (read from a checkpoint taken at the start)."""
    torch.manual_seed(0)
    model = BuiltInConfigureModel()
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=tmp_path if disk else None)
    trainer = fit(model, strategy, callbacks=[SaveAtStart(tmp_path / "start.ckpt")])
    assert model.built_on == torch.device("meta") and len(strategy.shards) == 5
    reference = BuiltInConfigureModel()
    reference.configure_model()
    initial = consolidate(str(tmp_path / "start.ckpt"))["state_dict"]
    assert all(value.abs().sum() > 0 for name, value in initial.items() if "weight" in name)
    reference.load_state_dict(initial)
    expected = fit(reference, "auto")
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_meta_module_without_reset_parameters_is_named():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.factor = nn.Parameter(torch.ones(DIM))

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return x * self.factor

    class WithScale(BuiltInConfigureModel):
        def configure_model(self) -> None:
            super().configure_model()
            self.blocks[2] = Scale()

    with pytest.raises(TypeError, match=r"`blocks\.2` \(Scale\) was built on the meta device .*reset_parameters"):
        fit(WithScale(), SpillingStrategy(memory_budget=BUDGETS[5]))


def test_a_metric_built_in_configure_model_is_named():
    """A torchmetrics metric built on the meta device has lost its starting values: set-up says to build it in
    `__init__` (as `BuiltInConfigureModel` does, whose metric trains on the device)."""

    class MetricInConfigureModel(BuiltInConfigureModel):
        def configure_model(self) -> None:
            super().configure_model()
            self.acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro")

    with pytest.raises(ValueError, match=r"metric `acc` was built in `configure_model`.*Build metrics in `__init__`"):
        fit(MetricInConfigureModel(), SpillingStrategy(memory_budget=BUDGETS[5]))
