"""SpillingStrategy's checkpoints: written a shard at a time in VarunaStrategy's sharded format, holding what
plain training holds; resumed at another budget, pipelined, from their consolidated file (by a plain Trainer too),
from a plain run's `last.ckpt` and from a plain Lightning file, with the losses and weights of an uninterrupted run."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyLM, token_dataset
from spilled_runs import BUDGETS, FrozenEmbeddingLM, assert_same_model, fit, losses
from torch.utils.data import DataLoader

from lightning_varuna import SpillingStrategy, VarunaStrategy
from lightning_varuna.checkpoint.consolidate import consolidate
from lightning_varuna.checkpoint.layout import open_complete
from lightning_varuna.storage import Storage


class GroupedTinyLM(TinyLM):
    """Two parameter groups, the first of them the parameters that come last in the model."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        matrices = [p for p in self.parameters() if p.ndim > 1]
        vectors = [p for p in self.parameters() if p.ndim <= 1]
        groups = [{"params": vectors[::-1], "weight_decay": 0.0}, {"params": matrices, "weight_decay": 0.5}]
        return torch.optim.AdamW(groups, lr=self.lr)


class EmptyGroupTinyLM(TinyLM):
    """A parameter group with no parameters (a model without biases, grouped for weight decay)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": list(self.parameters())}, {"params": [], "weight_decay": 0.0}], lr=self.lr)


def test_checkpoints_are_written_a_shard_at_a_time_and_resume_exactly(tmp_path):
    """A checkpoint taken mid-epoch while the model is spilled (VarunaStrategy's sharded format, written shard by
    shard) holds what plain training holds at that step; a run resumed from it at another budget continues the
    epoch where it stopped, with the losses and weights of an uninterrupted run."""
    torch.manual_seed(0)
    reference = TinyLM(scheduler=True)
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    uninterrupted = copy.deepcopy(reference)
    folder = tmp_path / "checkpoints"
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
    plain = fit(reference, "auto", max_steps=2)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=tmp_path)
    fit(model, strategy, max_steps=2, callbacks=[saves])
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    written = open_complete(Storage(), str(folder / "epoch=0-step=2.ckpt")).version_url
    parts = [name for name in os.listdir(written) if name.endswith(".distcp")]
    assert len(parts) == len(strategy.shards) + 1, "a part per shard, and one for what stays on the device"
    saved = consolidate(str(folder / "epoch=0-step=2.ckpt"))
    torch.testing.assert_close(saved["state_dict"], reference.state_dict())
    torch.testing.assert_close(saved["optimizer_states"], [plain.optimizers[0].state_dict()])  # torch's numbering
    assert saved["global_step"] == 2 and saved["lr_schedulers"] == [
        plain.lr_scheduler_configs[0].scheduler.state_dict()
    ]

    expected = fit(uninterrupted, "auto", max_steps=4)
    path = str(folder / "epoch=0-step=2.ckpt")
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[5]), ckpt_path=path, max_steps=4)
    torch.testing.assert_close(losses(continued), losses(expected)[4:], rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, uninterrupted)


@pytest.mark.parametrize("model_class", [TinyLM, EmptyGroupTinyLM])
def test_a_consolidated_checkpoint_resumes_where_the_sharded_one_does(tmp_path, model_class):
    """`lightning-varuna consolidate`'s one file, of a checkpoint taken mid-epoch, resumes spilled and pipelined with
    the losses and weights of an uninterrupted run: its position in the data is read, and its optimizer state, as
    torch numbers it or (with a group of no parameters, which has no name to keep) by name."""
    torch.manual_seed(0)
    reference = model_class()
    model, spilled, pipelined = (copy.deepcopy(reference) for _ in range(3))
    folder = tmp_path / "checkpoints"
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=2, callbacks=[ModelCheckpoint(dirpath=folder)])
    consolidated = str(tmp_path / "model.ckpt")
    torch.save(consolidate(str(folder / "epoch=0-step=2.ckpt")), consolidated)
    by_name = "optimizer_states_by_name" in torch.load(consolidated, weights_only=False)
    assert by_name == (model_class is EmptyGroupTinyLM)
    expected = fit(reference, "auto", max_steps=4)
    for strategy, resumed in ((SpillingStrategy(memory_budget=BUDGETS[5]), spilled), (VarunaStrategy(), pipelined)):
        continued = fit(resumed, strategy, ckpt_path=consolidated, max_steps=4)
        torch.testing.assert_close(losses(continued), losses(expected)[4:], rtol=1e-5, atol=1e-6)
        assert_same_model(resumed, reference)


@pytest.mark.parametrize("consolidated", [False, True])
def test_a_resume_at_another_global_batch_warns_from_a_folder_or_its_consolidated_file(tmp_path, consolidated):
    """A checkpoint records its run's global batch (8 rows here), and a resumed run with another says so, read from
    the checkpoint's folder or from its consolidated file (which dropped it before)."""
    torch.manual_seed(0)
    model = TinyLM()
    folder = tmp_path / "checkpoints"
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=2, callbacks=[ModelCheckpoint(dirpath=folder)])
    path = str(folder / "epoch=0-step=2.ckpt")
    if consolidated:
        torch.save(consolidate(path), tmp_path / "model.ckpt")
        path = str(tmp_path / "model.ckpt")
    smaller = DataLoader(token_dataset(64), batch_size=4)
    with pytest.warns(UserWarning, match="trained with a global batch of 8 rows; this run's is 4"):
        fit(model, VarunaStrategy(), ckpt_path=path, loader=smaller, max_steps=3)


def test_a_consolidated_checkpoint_resumes_a_plain_trainer_with_its_parameter_groups(tmp_path):
    """Consolidated, a spilled checkpoint numbers its optimizer state as torch does for the module's own parameter
    groups: a plain Trainer resumes from it and trains on as if never stopped."""
    torch.manual_seed(0)
    reference = GroupedTinyLM()
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    folder = tmp_path / "checkpoints"
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=4, callbacks=[ModelCheckpoint(dirpath=folder)])
    consolidated = str(tmp_path / "model.ckpt")
    torch.save(consolidate(str(folder / "epoch=0-step=4.ckpt")), consolidated)  # the end of the epoch
    expected = fit(reference, "auto", max_steps=6)
    continued = fit(resumed, "auto", ckpt_path=consolidated, max_steps=6)
    torch.testing.assert_close(losses(continued), losses(expected)[8:], rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, reference)


@pytest.mark.parametrize(
    ("strategy", "interrupted"), [(SpillingStrategy, False), (VarunaStrategy, False), (SpillingStrategy, True)]
)
def test_last_resumes_a_plain_runs_last_file_and_replaces_it(tmp_path, strategy, interrupted):
    """``ckpt_path="last"`` in the folder of a plain run's ``ModelCheckpoint(save_last=True)`` resumes from its
    ``last.ckpt`` file (it trained from scratch instead), and the strategy's own ``last.ckpt`` folder then takes
    that file's place (a folder cannot be written where the file is); where a save there set the file aside and
    never committed, "last" resumes from the file set aside. (VarunaStrategy reads the next epoch through
    Lightning's distributed sampler, which shuffles: the same batches as one device's in another order.)"""
    torch.manual_seed(0)
    reference = TinyLM(scheduler=True)
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    folder = tmp_path / "checkpoints"
    fit(model, "auto", max_steps=4, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)])
    assert (folder / "last.ckpt").is_file()
    if interrupted:  # as a save that set the file aside and stopped while writing leaves the folder
        (folder / "last.ckpt").rename(folder / "last.ckpt.replaced")
        (folder / "last.ckpt" / "v00000000000000000001").mkdir(parents=True)
    expected = fit(reference, "auto", max_steps=6)
    continued = fit(
        resumed, strategy(), "last", max_steps=6, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)]
    )
    assert len(losses(continued)) == 4  # the second epoch's batches
    if strategy is SpillingStrategy:
        torch.testing.assert_close(losses(continued), losses(expected)[8:], rtol=1e-5, atol=1e-6)
        assert_same_model(resumed, reference)
    assert (folder / "last.ckpt").is_dir() and sorted(p.name for p in folder.iterdir() if "last" in p.name) == [
        "last.ckpt"
    ]
    assert open_complete(Storage(), str(folder / "last.ckpt")).global_step == 6


@pytest.mark.parametrize("writer", ["varuna", "spilled"])
def test_a_checkpoint_of_an_optimizer_without_the_frozen_parameters_resumes_spilled(tmp_path, writer):
    """A frozen block left out of the optimizer (a frozen backbone, LoRA's base weights) has no optimizer state in
    the checkpoint; the spilled resume asked for it, and refused its own checkpoint as written "with different
    optimizers"."""
    torch.manual_seed(0)
    reference = FrozenEmbeddingLM()
    reference.blocks[0].requires_grad_(False)
    model = copy.deepcopy(reference)
    options: dict[str, Any] = {"limit_val_batches": 0, "max_steps": 6, "accumulate_grad_batches": 1}
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    writing = VarunaStrategy() if writer == "varuna" else SpillingStrategy(memory_budget=BUDGETS[5])
    expected = fit(reference, writing, callbacks=[saves], **options)
    resumed = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), str(tmp_path / "epoch=0-step=3.ckpt"), **options)
    torch.testing.assert_close(losses(resumed), losses(expected)[3:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_checkpoint_saved_after_fit_ended_by_max_epochs_resumes_with_the_next_epoch(tmp_path):
    """`save_checkpoint` after `fit(max_epochs=1)` (the model whole again), then `fit(max_epochs=2)` from it at
    another budget: the second epoch is trained, as in one uninterrupted two-epoch run."""
    torch.manual_seed(0)
    reference = TinyLM(scheduler=True)
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    expected = fit(reference, "auto", max_steps=-1, max_epochs=2)
    first = fit(model, SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=tmp_path), max_steps=-1, max_epochs=1)
    first.save_checkpoint(tmp_path / "end.ckpt")
    path = str(tmp_path / "end.ckpt")
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[5]), ckpt_path=path, max_steps=-1, max_epochs=2)
    assert len(losses(continued)) == len(losses(first)) == 8
    torch.testing.assert_close(losses(first) + losses(continued), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, reference)


def test_a_plain_lightning_checkpoint_resumes_spilled(tmp_path):
    """A checkpoint file of plain single-device training loads a shard at a time; the run continues as plain
    Lightning continues from it (which restarts an interrupted epoch's data)."""
    torch.manual_seed(0)
    reference = TinyLM()
    resumed, resumed_plainly = copy.deepcopy(reference), copy.deepcopy(reference)
    plain = fit(reference, "auto", max_steps=2)
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    path = str(tmp_path / "plain.ckpt")
    expected = fit(resumed_plainly, "auto", ckpt_path=path, max_steps=4)
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[5]), ckpt_path=path, max_steps=4)
    torch.testing.assert_close(losses(continued), losses(expected), rtol=1e-5, atol=1e-6)
    assert len(losses(continued)) == 4
    assert_same_model(resumed, resumed_plainly)
