"""MultiModelTrainer on one CUDA GPU: each model of a sweep trains exactly as alone on that GPU.

Skipped without a GPU (CI has none: these are the checks for a machine that has one).
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import lightning as L
import pytest
import torch
from models import TinyLM, token_dataset
from test_multi_model import MLP, QUIET, StepLosses, assert_same_weights, regression_data, step_losses
from torch.utils.data import DataLoader

from lightning_varuna import MultiModelTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def exact_matmuls() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def fit_alone_on_the_gpu(model: L.LightningModule, train: DataLoader, **kwargs: Any) -> L.Trainer:
    trainer = L.Trainer(accelerator="gpu", devices=1, callbacks=[StepLosses()], **{**QUIET, **kwargs})
    trainer.fit(model, train)
    return trainer


class WhereTheWeightsAre(L.Callback):
    """Whether all of the model's parameters are on the GPU, holding their elements, after each training batch."""

    def __init__(self) -> None:
        self.on_the_gpu: list[bool] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.on_the_gpu.append(all(p.is_cuda and p.numel() > 0 for p in pl_module.parameters()))


def sweep_on_the_gpu(specs: list[tuple[L.LightningModule, DataLoader, dict[str, Any]]], budget: str | None) -> tuple:
    sweep = MultiModelTrainer(accelerator="gpu", devices=1, memory_budget=budget, enable_progress_bar=False)
    losses = []
    for model, train, kwargs in specs:
        losses.append(StepLosses())
        sweep.add(model, train_dataloaders=train, callbacks=[losses[-1], WhereTheWeightsAre()], **{**QUIET, **kwargs})
    return sweep, sweep.fit(), losses


def weights_on_the_gpu(trainer: L.Trainer) -> list[bool]:
    return next(c for c in trainer.callbacks if isinstance(c, WhereTheWeightsAre)).on_the_gpu  # type: ignore[attr-defined]


@pytest.mark.parametrize("budget", ["400KB", None], ids=["cut-into-shards", "whole"])
def test_each_model_of_a_sweep_on_one_gpu_trains_as_if_alone(budget, tmp_path):
    """Models of different sizes, lengths, optimizers and precisions (one in ``16-mixed``) take turns on the GPU, cut
    into shards spilled to pinned host memory, or whole under the default budget, staying on the GPU (they all fit
    there): each one's losses and weights equal plain training on the GPU."""
    torch.manual_seed(0)
    specs: list[tuple[L.LightningModule, DataLoader, dict[str, Any]]] = [
        (MLP(48, 4), regression_data(48), {"max_steps": 9}),
        (MLP(96, 3, optimizer="sgd"), regression_data(96), {"max_steps": 5}),
        (
            TinyLM(),
            DataLoader(token_dataset(64), batch_size=8),
            {"max_steps": 6, "gradient_clip_val": 0.5, "accumulate_grad_batches": 2},
        ),
        (TinyLM(), DataLoader(token_dataset(64), batch_size=8), {"max_steps": 6, "precision": "16-mixed"}),
    ]
    references = [copy.deepcopy(model) for model, *_ in specs]
    sweep, trainers, losses = sweep_on_the_gpu(specs, budget)
    ended_s = time.perf_counter()

    assert [r.status for r in sweep.results] == ["finished"] * 4, [r.error for r in sweep.results]
    assert all(t.strategy.root_device.type == "cuda" for t in trainers)
    assert any(len(t.strategy.shards) > 1 for t in trainers) == (budget is not None)
    assert {s.device for s in sweep.spans} == {0}
    stayed = [all(weights_on_the_gpu(t)) for t in trainers]
    assert stayed == [len(t.strategy.shards) == 1 for t in trainers]
    assert all(stayed) == (budget is None)
    assert_gpu_spans_follow_the_turns(sweep, ended_s, tmp_path)
    for (model, train, kwargs), reference, sweep_losses in zip(specs, references, losses):
        alone = fit_alone_on_the_gpu(reference, train, **kwargs)
        torch.testing.assert_close(sweep_losses.losses, step_losses(alone), rtol=1e-5, atol=1e-6)
        assert_same_weights(model.cpu(), reference.cpu())


def assert_gpu_spans_follow_the_turns(sweep: MultiModelTrainer, ended_s: float, tmp_path) -> None:
    """The GPU's span of each turn (CUDA events) starts once the host has begun issuing it, ends by the end of the
    sweep, and follows the turn before it: every model issues to the GPU's one default stream, a turn at a time."""
    turns, ran = sweep.spans, sweep.gpu_spans
    assert [(s.model, s.work, s.shard, s.device) for s in ran] == [(s.model, s.work, s.shard, s.device) for s in turns]
    for host, gpu in zip(turns, ran):
        assert host.start_s - 1e-3 <= gpu.start_s <= gpu.end_s <= ended_s + 1e-3
    assert all(a.end_s <= b.start_s + 1e-5 for a, b in zip(ran, ran[1:]))
    assert sum(s.end_s - s.start_s for s in ran) > 0
    sweep.write_trace(tmp_path / "sweep.json")
    events = json.loads((tmp_path / "sweep.json").read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {"device 0", "GPU 0 (running)"}
    assert len([e for e in events if e["ph"] == "X"]) == 2 * len(turns)


def test_a_models_gpu_dropout_is_replayed_by_its_recompute():
    """A model whose dropout draws from the GPU's generator is found to draw, and replays its masks when its shards
    are recomputed for backward: beside a model that draws nothing, it trains exactly as alone on the GPU."""
    torch.manual_seed(0)
    dropout, plain = TinyLM(dropout=0.2), MLP(32, 3)
    references = [copy.deepcopy(dropout), copy.deepcopy(plain)]
    specs: list[tuple[L.LightningModule, DataLoader, dict[str, Any]]] = [
        (dropout, DataLoader(token_dataset(64), batch_size=8), {"max_steps": 6}),
        (plain, regression_data(32), {"max_steps": 6}),
    ]
    torch.manual_seed(1)
    sweep, trainers, losses = sweep_on_the_gpu(specs, "85KB")
    assert [r.status for r in sweep.results] == ["finished"] * 2, [r.error for r in sweep.results]
    assert len(trainers[0].strategy.shards) > 1
    names = [r.name for r in sweep.results]
    assert any(sweep.scheduler.clock(names[0]).draws.values())
    assert not any(sweep.scheduler.clock(names[1]).draws.values())

    torch.manual_seed(1)
    alone = fit_alone_on_the_gpu(references[0], specs[0][1], max_steps=6)
    torch.testing.assert_close(losses[0].losses, step_losses(alone), rtol=1e-5, atol=1e-6)
    assert_same_weights(dropout.cpu(), references[0].cpu())
