"""What a trainer's optimizers are set to (their groups' hyper-parameters) and where its learning-rate schedulers
stand, taken on one pipeline stage and set on the others: every stage has the parameter groups of one device
(`StageParameterGroups`), so a hook that runs on the last stage alone and changes a learning rate changes it on
every stage."""

from __future__ import annotations

import pickle
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["OptimizerSettings", "load_optimizer_settings", "optimizer_settings"]

# By optimizer and group, each group's hyper-parameters; by scheduler, its state.
OptimizerSettings = tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]
_NOT_SETTINGS = ("params", "param_names")  # a group's own parameters and their names


def optimizer_settings(trainer: pl.Trainer) -> OptimizerSettings:
    """The hyper-parameters of ``trainer``'s optimizers' groups (a tensor one on the CPU) and its schedulers' states.

    Raises:
        TypeError: a scheduler's state cannot be sent to the other stages (it cannot be pickled).
    """
    groups = [
        [
            {
                k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                for k, v in group.items()
                if k not in _NOT_SETTINGS
            }
            for group in optimizer.param_groups
        ]
        for optimizer in trainer.optimizers
    ]
    settings = groups, [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
    try:
        pickle.dumps(settings)
    except Exception as error:
        raise TypeError(
            f"An epoch-end hook runs on the last pipeline stage only, and the optimizers' settings and learning-rate "
            f"schedulers' states it may have changed are sent to the other stages; they cannot be pickled ({error}). "
            "Give the scheduler a state that pickles, or change it in an `on_*_epoch_start` hook or a callback."
        ) from error
    return settings


def load_optimizer_settings(trainer: pl.Trainer, settings: OptimizerSettings) -> None:
    """Set ``trainer``'s optimizers and schedulers as ``settings`` (of another stage's trainer) says."""
    groups, schedulers = settings
    for optimizer, saved in zip(trainer.optimizers, groups, strict=True):
        for group, values in zip(optimizer.param_groups, saved, strict=True):
            for key, value in values.items():
                if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].copy_(value)  # in place, on this stage's device
                else:
                    group[key] = value
    for config, state in zip(trainer.lr_scheduler_configs, schedulers, strict=True):
        config.scheduler.load_state_dict(state)
