"""Inside each model's Trainer: its progress, reported to the sweep's scheduler (its remaining time) and display."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_varuna.multimodel.generator_checkpoint import GeneratorCheckpoint
from lightning_varuna.multimodel.member import SweepMember
from lightning_varuna.multimodel.report import SweepDisplay
from lightning_varuna.multimodel.scheduler import DeviceScheduler

__all__ = ["SweepMemberCallback", "step_loss"]


def step_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> float | None:
    """The loss of the training batch that just ended (``outputs`` of ``on_train_batch_end``), if it returned one.
    Lightning hands on the loss divided by `accumulate_grad_batches` (what its backward ran on): undone here."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, torch.Tensor):
        return None
    accumulated = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    return float(loss.detach()) * accumulated


class SweepMemberCallback(GeneratorCheckpoint):
    """Reports ``member``'s progress to ``scheduler`` and to the sweep's display (``display()``: the one shown now,
    if any; a sweep makes it as it starts, after its models were added); keeps its generator state in its
    checkpoints."""

    def __init__(
        self, scheduler: DeviceScheduler, member: SweepMember, display: Callable[[], SweepDisplay | None]
    ) -> None:
        own_states, held = partial(scheduler.random_state, member.name), partial(scheduler.generator_held, member.name)
        super().__init__(member, scheduler.generator_device, own_states, held)
        self.scheduler, self.display = scheduler, display

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.member.steps_before = trainer.global_step
        self._report(trainer)
        display = self.display()
        if display is not None:
            display.started(self.member.name, trainer.estimated_stepping_batches, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = step_loss(trainer, pl_module, outputs)
        if loss is not None:
            self.member.last_loss = loss
        self._report(trainer)
        display = self.display()
        if display is not None:
            display.stepped(self.member.name, trainer.global_step, self.member.last_loss)

    def _report(self, trainer: pl.Trainer) -> None:
        steps_before = self.member.steps_before or 0
        decision = self.member.next_decision(trainer) if self.member.next_decision is not None else ()
        self.scheduler.stepped(
            self.member.name,
            trainer.global_step - steps_before,
            float(trainer.estimated_stepping_batches),
            steps_before,
            *decision,
        )
