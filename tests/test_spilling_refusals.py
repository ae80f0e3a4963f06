"""What SpillingStrategy does not train is refused at set-up, naming what to change, never trained differently:
a model compiled whole, averaging and fine-tuning callbacks that need every parameter on the device, pruning as it
trains, a grad-mode
block or a buffer of the model itself changed in its forward, CutPoints inside a reentrant checkpoint, more than one
device."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, EMAWeightAveraging, ModelPruning, StochasticWeightAveraging
from models import DIM, TinyLM
from spilled_runs import BUDGETS, FrozenEmbeddingLM, assert_same_model, fit, losses
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_varuna import SpillingStrategy, cut_after


def test_a_model_compiled_whole_is_refused():
    with pytest.raises(ValueError, match=r"compiled whole .*self\.net = torch\.compile\(net\)"):
        fit(torch.compile(TinyLM()), SpillingStrategy(memory_budget=BUDGETS[5]))


@pytest.mark.parametrize("averaging", [StochasticWeightAveraging, EMAWeightAveraging], ids=["swa", "ema"])
def test_weight_averaging_needs_the_model_on_the_device(averaging):
    """Averaging callbacks copy every parameter after each step: refused for a spilled model, with what to change;
    a model that stays on the device in one shard averages as plain Lightning does."""
    kwargs = {"swa_lrs": 0.01, "swa_epoch_start": 1} if averaging is StochasticWeightAveraging else {}
    with pytest.raises(ValueError, match=rf"`{averaging.__name__}` averages every parameter .*5 shard"):
        fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[5]), callbacks=[averaging(**kwargs)])
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    fit(reference, "auto", callbacks=[averaging(**kwargs)], max_steps=-1, max_epochs=3)
    fit(model, SpillingStrategy(memory_budget=BUDGETS[1]), callbacks=[averaging(**kwargs)], max_steps=-1, max_epochs=3)
    assert_same_model(model, reference)


def test_pruning_as_it_trains_needs_the_model_run_whole():
    """`ModelPruning` applies its masks through hooks it adds as the model trains, which a cut model's traced forward
    does not run (it failed in the backward): refused with what to do; a model that runs whole prunes as plain
    Lightning does."""
    with pytest.raises(ValueError, match=r"`ModelPruning` prunes the model as it trains.* in 5 shards .*before `fit`"):
        fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[5]), callbacks=[ModelPruning("l1_unstructured")])
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    options = {"max_steps": -1, "max_epochs": 3}  # pruned at each epoch's end, the masks made permanent at the fit's
    fit(reference, "auto", callbacks=[ModelPruning("l1_unstructured", amount=0.3)], **options)
    fit(model, SpillingStrategy(memory_budget=BUDGETS[1]), callbacks=[ModelPruning("l1_unstructured", amount=0.3)],
        **options)  # fmt: skip
    assert_same_model(model, reference)
    assert (model.blocks[0].fc.weight == 0).float().mean() > 0.5  # three rounds of 30% of what was left


# Cuts the TinyLMs below, which run one block (46 KB whole, where a budget of 85KB runs them whole).
ONE_BLOCK_CUT = "30KB"


class NoGradBlockLM(TinyLM):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0](self.blocks[0](self.emb(idx), torch.ones(())))
        with torch.no_grad():
            centre = x.mean(0)
        return self.head(x - centre)


def test_a_grad_mode_block_in_the_forward_is_named_with_what_to_use():
    with pytest.raises(RuntimeError, match=r"a `with torch\.no_grad\(\):` .*Use `\.detach\(\)`"):
        fit(NoGradBlockLM(), SpillingStrategy(memory_budget=ONE_BLOCK_CUT))


class CheckpointedLlama(L.LightningModule):
    """Hugging Face's gradient checkpointing, reentrant, with a CutPoint after each layer: inside the checkpoint."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2
        )
        self.model = LlamaForCausalLM(config)
        cut_after(self.model.model.layers)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_cutpoints_inside_a_reentrant_checkpoint_are_named_with_what_to_use():
    """torch's split merges their stages without an error (ours said that a stage had no computation)."""
    pytest.importorskip("transformers")
    trainer = L.Trainer(accelerator="cpu", strategy=SpillingStrategy(memory_budget="100KB"), max_steps=1, logger=False)
    data = DataLoader(torch.randint(1, 50, (8, 8)), batch_size=8)
    with pytest.raises(RuntimeError, match=r"a reentrant `torch\.utils\.checkpoint`.*`use_reentrant=False`"):
        trainer.fit(CheckpointedLlama(), data)


def test_cutpoints_inside_a_non_reentrant_checkpoint_train_cut_as_on_one_device():
    """What the refusal above says to use: Hugging Face's checkpointing with ``use_reentrant=False``, 4 shards."""
    pytest.importorskip("transformers")
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(CheckpointedLlama(reentrant=False))
    reference, model = models
    loader = DataLoader(torch.randint(1, 50, (32, 8), generator=torch.Generator().manual_seed(0)), batch_size=8)
    expected = fit(reference, "auto", loader=loader, limit_val_batches=0)
    strategy = SpillingStrategy(memory_budget="170KB")
    trainer = fit(model, strategy, loader=loader, limit_val_batches=0)
    assert len(strategy.shards) == 4
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_finetuning_that_unfreezes_parameters_outside_the_optimizer_is_refused():
    """`BaseFinetuning` finds what it unfreezes among the optimizer's parameters by their values, which spilled ones
    do not hold: an optimizer over the trainable parameters only is refused, with what to build instead."""
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    model = FrozenEmbeddingLM()
    model.backbone = model.blocks[0]  # what BackboneFinetuning freezes, then unfreezes
    with pytest.raises(ValueError, match=r"`BackboneFinetuning` would add .*over all of the model's parameters"):
        fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), callbacks=[finetuning])


class RootRunningMeanLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0](self.blocks[0](self.emb(idx), torch.ones(())))
        self.mean.copy_(0.5 * self.mean + 0.5 * x.mean((0, 1)).detach())
        return self.head(x - self.mean)


def test_a_buffer_of_the_model_itself_changed_in_place_is_named_with_what_to_do():
    with pytest.raises(TypeError, match=r"changes a buffer of the model itself in place .*in a submodule"):
        fit(RootRunningMeanLM(), SpillingStrategy(memory_budget=ONE_BLOCK_CUT))


def test_more_than_one_device_points_elsewhere():
    with pytest.raises(ValueError, match="VarunaStrategy.*MultiModelTrainer"):
        L.Trainer(accelerator="cpu", devices=2, strategy=SpillingStrategy())
