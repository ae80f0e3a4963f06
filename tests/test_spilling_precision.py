"""SpillingStrategy in mixed and true precisions, as on one device: bf16 autocast replayed in the recomputed
forwards, fp16 loss scaling that skips the steps one device skips (and resumes with its scale), the user's own
grad scaler kept, and float64 and bf16 parameters with the tensors the forward makes in their dtype."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from models import TinyLM
from spilled_runs import BUDGETS, LossScales, StepLosses, assert_same_model, fit, losses
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_varuna import SpillingStrategy


def test_bf16_mixed_trains_like_one_device():
    """The recomputed forwards run under the autocast of their first run."""
    torch.manual_seed(0)
    reference = TinyLM(dropout=0.1)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit(reference, "auto", precision="bf16-mixed")
    torch.manual_seed(1)
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), precision="bf16-mixed")
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def fp16_with_scale(init_scale: float) -> MixedPrecision:
    """``16-mixed`` as on CUDA, with a CPU grad scaler (Lightning offers the CPU bf16 only)."""
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))


class FusedAdamLM(TinyLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)  # it unscales its gradients itself


@pytest.mark.parametrize("budget", [BUDGETS[5], BUDGETS[1]], ids=["spilled", "fits"])
@pytest.mark.parametrize("model_class", [TinyLM, FusedAdamLM])
def test_fp16_loss_scaling_skips_the_steps_one_device_skips(budget, model_class):
    """``16-mixed``: the first scales overflow some shard's gradients, and the spilled run skips the same steps and
    backs off the scale as one device does (the overflow's gradients dropped, not summed into the next step's), with
    its losses and weights; gradients unscaled before they are clipped and accumulated over two batches. A fused
    optimizer (which Lightning does not let clip) gets the spilled gradients unscaled too."""
    torch.manual_seed(0)
    reference = model_class()
    model = copy.deepcopy(reference)
    expected_scales, scales = LossScales(), LossScales()
    options: dict[str, Any] = {"max_steps": 8}
    if model_class is FusedAdamLM:
        options["gradient_clip_val"] = None
    expected = fit(reference, "auto", plugins=[fp16_with_scale(2.0**18)], callbacks=[expected_scales], **options)
    strategy = SpillingStrategy(memory_budget=budget)
    trainer = fit(model, strategy, plugins=[fp16_with_scale(2.0**18)], callbacks=[scales], **options)

    assert (len(strategy.shards) > 1) == (budget == BUDGETS[5])
    assert expected_scales.scales[-1] == 2.0**15  # the first three steps overflowed and were skipped, not the others
    assert scales.scales == expected_scales.scales
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class CappedScaler(torch.amp.GradScaler):
    def update(self, new_scale: float | Tensor | None = None) -> None:
        super().update(new_scale)
        if self.get_scale() > 2.0**16:
            super().update(2.0**16)


def test_fp16_keeps_the_users_own_grad_scaler():
    """A grad scaler of the user's own class stays the plugin's, with what its class changes (a cap on the scale)."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected_scales, scales = LossScales(), LossScales()
    scaler = CappedScaler("cpu", init_scale=2.0**18)
    plugin = MixedPrecision("16-mixed", "cpu", scaler)
    expected_plugin = MixedPrecision("16-mixed", "cpu", CappedScaler("cpu", init_scale=2.0**18))
    fit(reference, "auto", max_steps=4, plugins=[expected_plugin], callbacks=[expected_scales])
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=4, plugins=[plugin], callbacks=[scales])
    assert plugin.scaler is scaler and isinstance(scaler, CappedScaler)
    assert scales.scales == expected_scales.scales
    assert max(scales.scales[1:]) == 2.0**16  # capped


def test_fp16_resumes_with_its_loss_scale(tmp_path):
    """A checkpoint taken after the overflowing steps keeps the backed-off scale: resumed at another budget, the
    spilled run goes on with the scales, losses and weights of an uninterrupted run on one device (plain Lightning,
    the same fp16 plugin, the same steps)."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected_scales, scales = LossScales(), LossScales()

    def fit_in_fp16(model: TinyLM, strategy: Any, ckpt_path: str | None = None, **kwargs: Any) -> L.Trainer:
        return fit(model, strategy, ckpt_path, plugins=[fp16_with_scale(2.0**18)], **kwargs)

    expected = fit_in_fp16(reference, "auto", max_steps=8, callbacks=[expected_scales])
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5)
    first = SpillingStrategy(memory_budget=BUDGETS[5])
    fit_in_fp16(copy.deepcopy(model), first, max_steps=5, callbacks=[saves])
    resumed = SpillingStrategy(memory_budget="95KB")  # 3 shards (TinyLM needs 103 KB whole)
    trainer = fit_in_fp16(model, resumed, saves.best_model_path, max_steps=8, callbacks=[scales])

    assert len(first.shards) > 1 and len(resumed.shards) > 1
    assert scales.scales == expected_scales.scales[10:]
    assert scales.scales[0] == 2.0**15  # the scale backed off by the first run's overflows
    torch.testing.assert_close(losses(trainer), losses(expected)[10:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


@pytest.mark.parametrize(
    ("name", "precision", "budget"),
    [
        # Each under what the model needs whole in that precision (20, 5.1, 678 and 171 KB): it runs cut.
        ("bn_mlp", "64-true", 16_000),  # float inputs, BatchNorm
        ("bn_mlp", "bf16-true", 4_000),
        ("demo_transformer", "64-true", 480_000),  # its first forward makes its positional encoding
        ("demo_transformer", "bf16-true", 120_000),
    ],
)
def test_true_precisions_train_cut_like_one_device(name, precision, budget):
    """The model's parameters and its float batches are converted to the precision's dtype, the first batch (on which
    set-up finds and measures the segments) too, and the tensors its forward makes get that dtype at set-up and in the
    backward's recomputes as in the steps (before, those runs made float32 tensors)."""
    from real_models import build

    torch.manual_seed(0)
    reference, data = build(name)
    model = copy.deepcopy(reference)
    options = dict(max_steps=3, precision=precision, callbacks=[StepLosses()], logger=False, enable_progress_bar=False)
    expected = L.Trainer(accelerator="cpu", devices=1, **options)
    expected.fit(reference, DataLoader(data, batch_size=4))
    strategy = SpillingStrategy(memory_budget=budget)
    options["callbacks"] = [StepLosses()]
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, **options)
    trainer.fit(model, DataLoader(data, batch_size=4))
    assert len(strategy.shards) > 1
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)
    assert next(model.parameters()).dtype == {"64-true": torch.float64, "bf16-true": torch.bfloat16}[precision]
