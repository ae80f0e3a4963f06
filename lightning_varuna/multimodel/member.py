"""One model of a sweep: what the sweep knows of it (`SweepMember`), and the `SpillingStrategy` it trains under,
whose shards wait for the sweep's devices (`SweepMemberStrategy`, launched in the model's own thread by
`SweepMemberLauncher`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_varuna.multimodel.held_loaders import ResumedEpoch, draw_holding
from lightning_varuna.multimodel.scheduler import DeviceScheduler, SweepStopped
from lightning_varuna.strategies.launchers import InProcessLauncher
from lightning_varuna.strategies.spilling import SpillingStrategy

__all__ = ["SweepMember", "SweepMemberLauncher", "SweepMemberStrategy"]


@dataclass
class SweepMember:
    """A model of the sweep: its name, the model, what `Trainer.fit` takes for it, and its progress."""

    name: str
    model: pl.LightningModule
    fit_kwargs: dict[str, Any]
    trainer: pl.Trainer = field(init=False)
    stays_on_device: bool = False  # if it fits its budget in one shard (`keep_on_device`, decided by `fit`)
    last_loss: float | None = None
    steps_before: int | None = None  # the global step at which this sweep's training started
    # When the next decision that may end it early comes (a global step), and the share that go on past it.
    next_decision: Callable[[pl.Trainer], tuple[float, float]] | None = None
    # torch's generators' state when it was added (`generator_states`): what its draws start from, as alone.
    random_state: list[torch.Tensor] = field(default_factory=list)
    resumed: ResumedEpoch | None = None  # a fit resumed from a checkpoint, until its first batch

    def resumed_training(self, trainer: pl.Trainer) -> ResumedEpoch | None:
        """Where the DataLoaders ``trainer`` processes now are the training ones of a fit resumed from a checkpoint
        that has not trained a batch yet, how it resumes."""
        return self.resumed if trainer.state.stage == RunningStage.TRAINING else None


class SweepMemberStrategy(SpillingStrategy):
    """`SpillingStrategy` whose shards wait for the sweep's devices; its set-up (which runs the model to measure it)
    holds a device and torch's global generator, and it traces its forward while the other models wait."""

    step_in_one_turn = True  # a model that stays on the device steps in one turn (`optimizer_step`)

    def __init__(self, scheduler: DeviceScheduler, member: SweepMember, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scheduler, self.sweep_name, self._member = scheduler, member.name, member

    @override
    def _configure_launcher(self) -> None:
        self._launcher = SweepMemberLauncher(self.scheduler)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        with self.scheduler.turn(self.sweep_name, "set-up", -1, generator=True):
            super().setup(trainer)
        clock = self.scheduler.clock(self.sweep_name)
        clock.size = sum(m.state_bytes + m.activation_bytes for m in self.segment_memory)
        if not self.forward_draws:  # measured holding the generator: none of its turns needs it, not even its first
            clock.draws.update({(i, self._module.training): False for i in range(len(self.shards))})

    @override
    def barrier(self, name: str | None = None) -> None:
        """Hold torch's global generator from just before the fit's ``setup`` hooks (``"pre_setup"``, after
        ``prepare_data``) until training starts (`on_train_start`): what its set-up draws (a datamodule's split, the
        sanity check, which restores the generator's state as it ends) comes from the model's own generator state,
        and no other model's forward draws meanwhile."""
        super().barrier(name)
        if name == "pre_setup" and self._module.trainer.state.fn == TrainerFn.FITTING:
            self.scheduler.hold_generator(self.sweep_name)

    @override
    def on_train_start(self) -> None:
        self.scheduler.release_generator(self.sweep_name)
        super().on_train_start()

    @override
    def teardown(self) -> None:
        self.scheduler.release_generator(self.sweep_name)
        super().teardown()

    @override
    def _tracing(self) -> AbstractContextManager[None]:
        return self.scheduler.alone(self.sweep_name)

    @override
    def _turn(self, work: str, shard: int) -> AbstractContextManager[bool]:
        return self.scheduler.turn(self.sweep_name, work, shard, training=self._module.training)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """A model that stays on the device (in one shard) takes its whole step, training step, backward and
        optimizer step, in one turn rather than a turn each for its forward and its backward: a small model's step
        takes a few milliseconds, as long as handing a device over."""
        if not (self.step_in_one_turn and self._sharded_model().stays):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        draws = self.scheduler.clock(self.sweep_name).draws.get((0, True)) is not False
        with self.scheduler.turn(self.sweep_name, "step", 0, training=True, generator=draws):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def _keeps_whole_model(self) -> bool:
        return self._member.stays_on_device

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A DataLoader draws from torch's global generator holding the model's own generator state, as alone
        (`draw_holding`)."""
        dataloader = super().process_dataloader(dataloader)
        if not isinstance(dataloader, DataLoader):
            return dataloader
        resumed = self._member.resumed_training(self._module.trainer)
        return draw_holding(dataloader, partial(self.scheduler.generator_held, self.sweep_name), resumed)


class SweepMemberLauncher(InProcessLauncher):
    """A KeyboardInterrupt raised in a model's step stops the sweep, as Ctrl-C does; that model's fit ends as on any
    error (Lightning's own handling of it would ignore SIGINT, which a model's thread may not, and skip the
    teardown that brings its spilled weights back)."""

    def __init__(self, scheduler: DeviceScheduler) -> None:
        self.scheduler = scheduler

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except KeyboardInterrupt as interrupt:
            self.scheduler.stop("KeyboardInterrupt")
            raise SweepStopped("the sweep was stopped (KeyboardInterrupt in this model's step)") from interrupt
