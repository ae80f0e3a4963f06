"""What a trainer's optimizers are set to (their groups' hyper-parameters) and where its learning-rate schedulers
stand, taken on one pipeline stage and set on the others: every stage has the parameter groups of one device
(`StageParameterGroups`), so a hook that runs on the last stage alone and changes a learning rate changes it on
every stage."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["OptimizerSettings", "load_optimizer_settings", "optimizer_settings"]

# By optimizer and group, each group's hyper-parameters; by scheduler, its state.
OptimizerSettings = tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]


def optimizer_settings(trainer: pl.Trainer) -> OptimizerSettings:
    """The hyper-parameters of ``trainer``'s optimizers' groups (all but their parameters) and its schedulers'
    states."""
    groups = [
        [{key: value for key, value in group.items() if key != "params"} for group in o.param_groups]
        for o in trainer.optimizers
    ]
    return groups, [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]


def load_optimizer_settings(trainer: pl.Trainer, settings: OptimizerSettings) -> None:
    """Set ``trainer``'s optimizers and schedulers as ``settings`` (of another stage's trainer) says."""
    groups, schedulers = settings
    for optimizer, saved in zip(trainer.optimizers, groups, strict=True):
        for group, values in zip(optimizer.param_groups, saved, strict=True):
            group.update(values)
    for config, state in zip(trainer.lr_scheduler_configs, schedulers, strict=True):
        config.scheduler.load_state_dict(state)
