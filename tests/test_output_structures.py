"""A forward whose output has another structure for other arguments, as Hugging Face models return a loss with the
logits when given labels and the logits alone without: training and the validation inside `fit` (and `validate`
before `fit` on the same Trainer) give one device's values under both strategies."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from real_models import GPT2_VOCAB, tiny_gpt2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import CutPoint, SpillingStrategy, VarunaStrategy


class LossWhenGivenTargets(L.LightningModule):
    """``{"loss", "logits"}`` with targets, ``{"logits", "probs"}`` without: as many tensors either way."""

    cut_budget = "8KB"  # three shards under SpillingStrategy (it needs 9.5 KB whole)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)])
        self.cuts = nn.ModuleList(CutPoint() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.layers[2](self.cuts[1](torch.tanh(self.layers[1](self.cuts[0](torch.tanh(self.layers[0](x)))))))
        if y is None:
            return {"logits": h, "probs": h.softmax(-1)}
        return {"loss": F.cross_entropy(h, y), "logits": h}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self(x, y)["loss"]
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)["logits"]
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_logits_mean", logits.mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    @staticmethod
    def data(rows: int) -> TensorDataset:
        g = torch.Generator().manual_seed(rows)
        return TensorDataset(torch.randn(rows, 8, generator=g), torch.randint(4, (rows,), generator=g))


class GPT2WithLabels(LossWhenGivenTargets):
    """Hugging Face's GPT-2: a `CausalLMOutputWithCrossAttentions` of the loss and the logits given labels, of the
    logits alone (and its key/value cache) without."""

    cut_budget = "320KB"  # three shards (it needs 385 KB whole)

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = tiny_gpt2()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids=ids, labels=labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, labels = batch
        logits = self(ids).logits
        self.log("val_loss", F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))
        self.log("val_logits_mean", logits.mean())

    @staticmethod
    def data(rows: int) -> TensorDataset:
        ids = torch.randint(GPT2_VOCAB, (rows, 8), generator=torch.Generator().manual_seed(rows))
        return TensorDataset(ids, ids)


class ValidationValues(L.Callback):
    def __init__(self) -> None:
        self.values: list[dict[str, float]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        self.values.append({name: float(metrics[name]) for name in ("val_loss", "val_logits_mean")})


STRATEGIES = {
    "varuna": lambda model_class: VarunaStrategy(),
    "spilled-cut": lambda model_class: SpillingStrategy(memory_budget=model_class.cut_budget),
    "spilled-whole": lambda model_class: SpillingStrategy(memory_budget="1GB"),
}


def run(model_class: type, strategy: Any, validate_first: bool) -> tuple[L.LightningModule, list[dict[str, float]]]:
    """Train 6 steps on batches of 4, validating (batches of 8) every 3, after a `validate` if ``validate_first``."""
    torch.manual_seed(0)
    model, values = model_class(), ValidationValues()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=6,
        val_check_interval=3,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # VarunaStrategy's would shuffle: the batches in order, as on one device
        callbacks=[values],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    val = DataLoader(model_class.data(8), batch_size=8)
    if validate_first:
        trainer.validate(model, val, verbose=False)
    trainer.fit(model, DataLoader(model_class.data(24), batch_size=4), val)
    return model, values.values


@pytest.mark.parametrize(
    "model_class",
    [LossWhenGivenTargets, pytest.param(GPT2WithLabels, marks=pytest.mark.slow)],  # GPT-2: 2-3 s a run
    ids=["dict", "hugging-face"],
)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("validate_first", [False, True], ids=["fit", "validate-then-fit"])
def test_the_validation_inside_fit_sees_the_structure_its_own_call_returns(model_class, strategy, validate_first):
    """Before, the output's structure of the first traced call (training's) was given to every later one: the
    validation read the probabilities as the logits (the same number of tensors) or failed to rebuild the output
    (another number), and a `validate` first chose the micro-batch size from its larger batch (`fit` then failed)."""
    if model_class is GPT2WithLabels:
        pytest.importorskip("transformers")
    expected_model, expected = run(model_class, "auto", validate_first)
    chosen = STRATEGIES[strategy](model_class)
    model, values = run(model_class, chosen, validate_first)
    if strategy == "spilled-cut":
        assert len(chosen.shards) == 3
    assert len(values) == len(expected) == 2 + validate_first
    for got, want in zip(values, expected):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for (name, got), want in zip(model.state_dict().items(), expected_model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
