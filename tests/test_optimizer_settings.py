"""The optimizers' settings and schedulers' states that an epoch-end hook run on the last pipeline stage changed,
taken there and set on another stage's trainer (`lightning_varuna.pipeline.optimizer_settings`)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig

from lightning_varuna.pipeline.optimizer_settings import load_optimizer_settings, optimizer_settings


def trainer_with(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.optimizers = [optimizer]
    trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(scheduler)]
    return trainer


def stage(lr: torch.Tensor | float) -> L.Trainer:
    """A stage's trainer: its own parameters, an SGD with two groups and a step scheduler."""
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))]}, {"params": [], "momentum": 0.5}]
    optimizer = torch.optim.SGD(groups, lr=lr)
    return trainer_with(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))


def test_the_last_stage_s_learning_rates_and_scheduler_are_set_on_another_stage():
    last, other = stage(torch.tensor(0.1)), stage(torch.tensor(0.1))
    other_lr = other.optimizers[0].param_groups[0]["lr"]
    for group in last.optimizers[0].param_groups:  # set by hand in the hook
        group["lr"] = group["lr"] * 0.25
    last.lr_scheduler_configs[0].scheduler.step()  # stepped by hand in the hook
    load_optimizer_settings(other, optimizer_settings(last))
    groups = other.optimizers[0].param_groups
    assert [float(g["lr"]) for g in groups] == [float(g["lr"]) for g in last.optimizers[0].param_groups]
    assert groups[0]["lr"] is other_lr  # a tensor setting is copied into, on this stage's device
    assert groups[1]["momentum"] == 0.5 and groups[0]["params"] is not last.optimizers[0].param_groups[0]["params"]
    assert other.lr_scheduler_configs[0].scheduler.last_epoch == 1


def test_a_scheduler_whose_state_cannot_be_sent_is_refused_with_what_to_do():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    scheduler.unsent = lambda epoch: epoch  # a lambda does not pickle
    with pytest.raises(TypeError, match="cannot be pickled.*on_\\*_epoch_start"):
        optimizer_settings(trainer_with(optimizer, scheduler))
