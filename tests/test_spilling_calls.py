"""A step that calls the model more than once trains spilled exactly as on one device: a consistency loss over two
calls, a second call under `torch.no_grad` for a metric, two calls in `validation_step`; cut into several shards, in
host memory and on disk, with dropout (each call's masks replayed for its own backward)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from models import TinyLM
from spilled_runs import BUDGETS, StepLosses, assert_same_model, fit, losses
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import SpillingStrategy
from lightning_varuna.demos import MLP
from lightning_varuna.partition.trace_cache import KEPT_TRACES, Traces, _Value


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
@pytest.mark.parametrize("num_shards", [3, 5])
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


class SkipsOddBatchesLM(TinyLM):
    """`training_step` returns None on odd batches: with two batches a step, the last batch of each window skips."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


@pytest.mark.parametrize("clip", [0.5, None], ids=["clipped", "stepped-in-backward"])
def test_a_window_whose_last_batch_skips_steps_on_the_batches_before_like_one_device(clip):
    """Lightning steps the optimizer on what the window's other batches accumulated even when the last batch's
    step returns None; a spilled model that steps each shard in its backward must step them all the same (it did not
    step, and carried the gradients into the next window)."""
    torch.manual_seed(0)
    reference = SkipsOddBatchesLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto", gradient_clip_val=clip, limit_val_batches=0)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5])
    trainer = fit(model, strategy, gradient_clip_val=clip, limit_val_batches=0)
    assert strategy.optimizer_in_backward == (clip is None)
    assert trainer.global_step == expected.global_step == 4
    assert_same_model(model, reference)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), TinyLM().parameters()))


class Refiner(MLP):
    """Six layers, a CutPoint after each but the last; its step feeds the output back in."""

    def __init__(self) -> None:
        super().__init__(16, 6, optimizer="sgd", lr=0.1)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(self(x)), y)


def fit_refiner(model: L.LightningModule, strategy: Any, steps: int = 4, **kwargs: Any) -> L.Trainer:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, callbacks=[StepLosses()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=16))
    return trainer


def test_a_call_on_an_earlier_calls_output_is_refused_before_any_step():
    model = Refiner()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"calls `self\(\.\.\.\)` again on a tensor that needs a gradient"):
        fit_refiner(model, SpillingStrategy(memory_budget="20KB"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


class CallsInAnEpochEndHook(TinyLM):
    def on_train_epoch_end(self) -> None:
        self(torch.zeros(2, 3, dtype=torch.long, device=self.device))


def test_a_call_outside_a_step_is_refused_naming_the_module():
    with pytest.raises(RuntimeError, match=r"`blocks\.0\.norm` runs while its parameters are spilled: .*inside"):
        fit(CallsInAnEpochEndHook(), SpillingStrategy(memory_budget=BUDGETS[5]), max_epochs=1, max_steps=-1)


class NotedLM(TinyLM):
    """A forward that takes a value that is not a tensor, other at every step (a note it does not read)."""

    def forward(self, idx: torch.Tensor, note: str = "") -> torch.Tensor:
        return super().forward(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        loss = F.cross_entropy(self(idx, f"batch {batch_idx}").flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss


def test_a_value_that_is_not_a_tensor_and_changes_traces_again_with_a_warning_once_like_one_device():
    """Each new value makes a trace (the trace holds it fixed), as few kept as `KEPT_TRACES` says; the first new
    one is warned of, with what to do; the model trains as on one device."""
    torch.manual_seed(0)
    reference = NotedLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto", max_steps=6, accumulate_grad_batches=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match=r"`NotedLM` is traced again .*'batch 0' before, 'batch 1' now") as warned:
        trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=6, accumulate_grad_batches=1,
                      limit_val_batches=0)  # fmt: skip
    assert len([w for w in warned if "traced again" in str(w.message)]) == 1
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_traces_are_kept_up_to_their_number_and_made_again_when_asked_after():
    made: list[tuple] = []

    def trace_of(key: tuple) -> Callable[[], tuple]:
        return lambda: made.append(key) or key

    traces: Traces[tuple] = Traces("`M`")
    keys = [(True, ((2, 3), torch.float32, "cpu"), _Value(repr(n))) for n in range(KEPT_TRACES + 1)]
    with pytest.warns(UserWarning, match="traced again") as warned:
        for key in keys:
            assert traces.get(key, trace_of(key)) == key
    assert len(warned) == 1 and made == keys
    traces.get(keys[-1], trace_of(keys[-1]))  # kept
    traces.get(keys[0], trace_of(keys[0]))  # the least recently used, dropped: made again
    assert made == [*keys, keys[0]]
    other_shape = (True, ((4, 3), torch.float32, "cpu"), _Value("0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # another shape is traced again without a word
        traces.get(other_shape, trace_of(other_shape))
