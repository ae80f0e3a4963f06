"""What Lightning leaves undone when it resumes a fit in the middle of an epoch.

Lightning runs no ``on_train_epoch_start`` hook for an epoch it resumes mid-way, so a `GradientAccumulationScheduler`
never sets that epoch's accumulation: the resumed run steps at every batch (or at the last epoch's rate) where the
uninterrupted run accumulated, and trains another model. Both strategies set it at the start of the fit, as the
callback would have at the epoch's start.

A checkpoint taken between the batches of an accumulated step holds no gradients, so the resumed run's first step
trains on fewer batches than the uninterrupted run's, in Lightning as here. Lightning says nothing of it; both
strategies warn.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_varuna.strategies.callback_hooks import callbacks_of

__all__ = ["accumulate_as_scheduled", "warn_if_an_accumulated_step_was_cut"]


def accumulate_as_scheduled(trainer: pl.Trainer) -> None:
    """Set ``trainer.accumulate_grad_batches`` for the current epoch as its `GradientAccumulationScheduler` says."""
    for scheduler in callbacks_of(trainer, GradientAccumulationScheduler):
        trainer.accumulate_grad_batches = scheduler.get_accumulate_grad_batches(trainer.current_epoch)


def warn_if_an_accumulated_step_was_cut(trainer: pl.Trainer) -> None:
    """At the start of ``trainer``'s training: warn where the checkpoint it resumed was taken between the batches of
    an accumulated step, whose gradients it does not hold."""
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress  # (`current` is typed as its base class)
    accumulated = progress.current.processed % trainer.accumulate_grad_batches
    if accumulated and not progress.is_last_batch:
        rank_zero_warn(
            f"The checkpoint was taken {accumulated} batch(es) into a step that accumulates "
            f"{trainer.accumulate_grad_batches} (`accumulate_grad_batches`), and holds no gradients: the resumed run's "
            f"first optimizer step trains on its other {trainer.accumulate_grad_batches - accumulated} batch(es) "
            "only, where the uninterrupted run's trained on all of them (as in plain Lightning). To resume exactly, "
            "checkpoint at optimizer steps (`ModelCheckpoint(every_n_train_steps=...)`, `on_train_batch_end` when "
            "`(batch_idx + 1) % accumulate_grad_batches == 0`)."
        )
