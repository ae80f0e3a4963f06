"""What Lightning leaves undone when it resumes a fit in the middle of an epoch.

Lightning runs no ``on_train_epoch_start`` hook for an epoch it resumes mid-way, so a `GradientAccumulationScheduler`
never sets that epoch's accumulation: the resumed run steps at every batch (or at the last epoch's rate) where the
uninterrupted run accumulated, and trains another model. Both strategies set it at the start of the fit, as the
callback would have at the epoch's start.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_varuna.strategies.callback_hooks import callbacks_of

__all__ = ["accumulate_as_scheduled"]


def accumulate_as_scheduled(trainer: pl.Trainer) -> None:
    """Set ``trainer.accumulate_grad_batches`` for the current epoch as its `GradientAccumulationScheduler` says."""
    for scheduler in callbacks_of(trainer, GradientAccumulationScheduler):
        trainer.accumulate_grad_batches = scheduler.get_accumulate_grad_batches(trainer.current_epoch)
