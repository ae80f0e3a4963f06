"""A sweep's model's own generator state in its checkpoints: a fit resumed from one draws the random numbers
(dropout masks, DataLoader seeds) that the uninterrupted fit would have drawn next, so it goes on exactly as that fit.

What Lightning draws as it resumes, before the next step, is what the uninterrupted fit drew there: the seeds of a
validation due after the checkpoint's step (which the resumed fit passes over) and of the next epoch's training
DataLoader. But an epoch resumed mid-way starts its training DataLoader's iteration again, which the uninterrupted
fit did not, and reads again the batch the uninterrupted fit had read ahead before the checkpoint: those draw
without moving the model's state (`SweepMember.resumes_mid_epoch`, `draw_holding`), so that batch alone is augmented
anew by a dataset that draws."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_varuna.multimodel.member import SweepMember
from lightning_varuna.pipeline.replay import generator_states, set_generator_states

__all__ = ["CHECKPOINT_KEY", "GeneratorCheckpoint"]

CHECKPOINT_KEY = "sweep_model_generator"  # of the checkpoint's dict: the states, and whether it was taken mid-epoch


class GeneratorCheckpoint(pl.Callback):
    """Keeps ``member``'s generator state in its checkpoints and puts it back in a fit resumed from one; ``held()``
    makes torch's global generators the model's own (a hold of the sweep's scheduler, or nothing where the model is
    alone in its process), ``device`` the device whose generators it draws from."""

    def __init__(
        self, member: SweepMember, held: Callable[[], AbstractContextManager[Any]], device: torch.device
    ) -> None:
        self.member, self._held, self._device = member, held, device

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        with self._held():
            states = generator_states(self._device)
        mid_epoch = not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        checkpoint[CHECKPOINT_KEY] = {"states": states, "mid_epoch": mid_epoch}

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:  # written by another Trainer than a sweep's
            return
        with self._held():
            set_generator_states(saved["states"], self._device)
        self.member.resumed_mid_epoch = saved["mid_epoch"]
