"""When a trial's pruner next decides, and how likely the trial is to go on past it: what the device scheduler needs
to rank trials that may end early (see `DeviceScheduler`'s module).

A pruner decides when the trial reports, after a validation; Optuna's pruners decide only at some of those: the
successive-halving pruner at its rungs (``min_resource * reduction_factor ** (min_early_stopping_rate + k)`` steps),
the median and percentile pruners from ``n_warmup_steps`` on, every ``interval_steps``. The next decision is the first
validation at or after the pruner's next deciding step. How likely a trial is to go on: successive halving and
Hyperband promote one in ``reduction_factor`` at a rung, the percentile pruner keeps the ``percentile`` best (the
median pruner: half); a pruner this module does not know is taken to keep half, at every validation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import lightning.pytorch as pl

from lightning_varuna._optuna_private import pruner_settings

if TYPE_CHECKING:
    import optuna

__all__ = ["NEVER", "next_decision", "next_validation"]

NEVER = math.inf  # the step of a decision that never comes (no pruner, no validation)


def next_validation(trainer: pl.Trainer, after: int) -> tuple[float, float]:
    """The first global step after ``after`` at whose end ``trainer`` validates, and the steps between its
    validations (roughly: validations are counted in batches, and at epoch ends); `NEVER` if it does not validate."""
    if not trainer.enable_validation or not trainer.num_val_batches:
        return NEVER, NEVER
    batches = trainer.val_check_batch
    if batches is None or math.isinf(batches):
        return NEVER, NEVER
    per_epoch = trainer.num_training_batches
    if trainer.check_val_every_n_epoch is not None and not math.isinf(per_epoch) and batches >= per_epoch:
        batches = per_epoch * trainer.check_val_every_n_epoch
    every = max(float(batches) / max(trainer.accumulate_grad_batches, 1), 1.0)
    return (math.floor(after / every) + 1) * every, every


def next_decision(pruner: optuna.pruners.BasePruner, step: int, validation: float, every: float) -> tuple[float, float]:
    """The step of ``pruner``'s next decision on a trial at global step ``step``, whose next validation is at
    ``validation`` and which validates every ``every`` steps; and the share of trials that go on past it."""
    import optuna

    if isinstance(pruner, optuna.pruners.NopPruner) or math.isinf(validation):
        return NEVER, 1.0
    if isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner):
        settings = pruner_settings(pruner, "min_resource", "reduction_factor", "min_early_stopping_rate")
        if settings is None or not isinstance(settings[0], int):  # "auto": known once a trial has finished
            return validation, 1.0 / (pruner_settings(pruner, "reduction_factor") or (2,))[0]
        min_resource, factor, rate = settings
        rung = min_resource * factor**rate
        while rung <= step:
            rung *= factor
        return _first_validation_from(rung, validation, every), 1.0 / factor
    if isinstance(pruner, optuna.pruners.HyperbandPruner):
        return validation, 1.0 / (pruner_settings(pruner, "reduction_factor") or (2,))[0]
    if isinstance(pruner, optuna.pruners.PercentilePruner):  # the median pruner is one
        settings = pruner_settings(pruner, "n_warmup_steps", "interval_steps", "percentile")
        if settings is None:
            return validation, 0.5
        warmup, interval, percentile = settings
        deciding = max(warmup, step + 1)
        deciding = warmup + math.ceil((deciding - warmup) / interval) * interval
        return _first_validation_from(deciding, validation, every), percentile / 100.0
    return validation, 0.5


def _first_validation_from(step: float, validation: float, every: float) -> float:
    """The first validation step at or after ``step``, validations being at ``validation`` + k ``every``."""
    if step <= validation:
        return validation
    return validation + math.ceil((step - validation) / every) * every
