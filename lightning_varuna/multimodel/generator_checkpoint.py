"""A sweep's model's own generator state in its checkpoints: a fit resumed from one draws the random numbers
(dropout masks, DataLoader seeds, a dataset's augmentations) that the uninterrupted fit would have drawn next, so it
goes on exactly as that fit.

As it resumes, before the next step, Lightning draws the seed of a validation due after the checkpoint's step (which
the resumed fit passes over), as the uninterrupted fit did. It starts the training DataLoaders once or twice, where
the uninterrupted fit started them once at an epoch's start and not at all mid-epoch: `ResumedEpoch` says which of
those iterations draw from the model's state."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_varuna.multimodel.held_loaders import ResumedEpoch
from lightning_varuna.multimodel.member import SweepMember
from lightning_varuna.pipeline.replay import generator_states, set_generator_states

__all__ = ["CHECKPOINT_KEY", "GeneratorCheckpoint"]

CHECKPOINT_KEY = "sweep_model_generator"  # of the checkpoint's dict: the states, and whether it was taken mid-epoch


class GeneratorCheckpoint(pl.Callback):
    """Keeps ``member``'s generator state (``own_states()``, those of the generators ``device`` draws from) in its
    checkpoints and puts it back in a fit resumed from one, inside ``held()``, which makes torch's global generators
    the model's own (a hold of the sweep's scheduler, or nothing where the model is alone in its process)."""

    def __init__(
        self,
        member: SweepMember,
        device: torch.device,
        own_states: Callable[[], list[torch.Tensor]],
        held: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        self.member, self._device, self._own_states, self._held = member, device, own_states, held

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            mid_epoch = not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
            checkpoint[CHECKPOINT_KEY] = {"states": self._own_states(), "mid_epoch": mid_epoch}

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:  # written by another Trainer than a sweep's
            return
        states, current = saved["states"], generator_states(self._device)
        if len(states) < len(current):
            rank_zero_warn(
                f"{self.member.name}'s checkpoint was written on the CPU: on {self._device} it draws its GPU's random "
                "numbers (dropout on the GPU) from another state than the fit it resumes would have."
            )
        with self._held():
            set_generator_states(states[:1] + current[1:] if len(states) < len(current) else states, self._device)
        self.member.resumed = ResumedEpoch(mid_epoch=saved["mid_epoch"])

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, i: int) -> None:
        if self.member.resumed is not None:  # its training goes on: a later epoch starts as any
            self.member.resumed.active = False
            self.member.resumed = None
