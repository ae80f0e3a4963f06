"""A step that calls the model more than once trains spilled exactly as on one device: a consistency loss over two
calls, a second call under `torch.no_grad` for a metric, two calls in `validation_step`; cut into several shards, in
host memory and on disk, with dropout (each call's masks replayed for its own backward)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import TinyLM
from spilled_runs import BUDGETS, assert_same_model, fit, losses

from lightning_varuna import SpillingStrategy


class ConsistencyLM(TinyLM):
    """Both calls in the loss: the prediction on the input and on the input reversed should agree."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        logits = self(idx)
        reversed_logits = self(idx.flip(1)).flip(1)
        agreement = F.mse_loss(logits.softmax(-1), reversed_logits.softmax(-1))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + agreement
        self.log("train_loss", loss)
        return loss


class NoGradMetricLM(TinyLM):
    """A second call without gradients, for a metric only."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        logits = self(idx)
        with torch.no_grad():
            self.eval()
            clean = self(idx)
            self.train()
        self.log("clean_agreement", (logits.argmax(-1) == clean.argmax(-1)).float().mean())
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss


class ThreeCallsLM(ConsistencyLM):
    """A metric call without gradients between two calls in the loss; two calls in `validation_step` too."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        first = self(idx)
        with torch.no_grad():
            self.log("first_agreement", (self(idx).argmax(-1) == y).float().mean())
        second = self(idx.flip(1)).flip(1)
        loss = F.cross_entropy(first.flatten(0, 1), y.flatten()) + F.mse_loss(first, second)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, y = batch
        both = self(idx) + self(idx.flip(1)).flip(1)
        self.log("val_loss", F.cross_entropy(both.flatten(0, 1), y.flatten()))


@pytest.mark.parametrize("model_class", [ConsistencyLM, NoGradMetricLM, ThreeCallsLM])
@pytest.mark.parametrize("num_shards", [2, 5])
@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_a_step_calling_the_model_several_times_trains_like_one_device(tmp_path, model_class, num_shards, disk):
    torch.manual_seed(0)
    reference = model_class(dropout=0.1, scheduler=True)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit(reference, "auto")
    torch.manual_seed(1)
    strategy = SpillingStrategy(memory_budget=BUDGETS[num_shards], spill_dir=tmp_path if disk else None)
    trainer = fit(model, strategy)
    assert len(strategy.shards) == num_shards
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert len(set(losses(trainer))) > 1
    metrics = {k: v for k, v in expected.callback_metrics.items()}
    assert trainer.callback_metrics.keys() == metrics.keys()
    for name, value in metrics.items():
        torch.testing.assert_close(trainer.callback_metrics[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert_same_model(model, reference)
