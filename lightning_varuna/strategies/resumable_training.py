"""`ResumableTraining`: what `VarunaStrategy` and `SpillingStrategy` do alike around Lightning's hooks, once: the
checkpoint storage, checkpoints loaded after set-up (into the cut model), the training data's position (resumable
mid-epoch), and the end of a run."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightning_varuna.data.resumable import DataProgress
from lightning_varuna.storage import Storage
from lightning_varuna.strategies.callback_hooks import restore_callback_hooks
from lightning_varuna.strategies.mid_epoch_resume import accumulate_as_scheduled, warn_if_an_accumulated_step_was_cut

__all__ = ["ResumableTraining"]


class ResumableTraining(Strategy):
    """A strategy whose checkpoints are sharded by parameter name at any fsspec URL and whose training data resumes
    mid-epoch at the next batch. Mixed in before Lightning's strategy class: ``storage_options`` (fsspec options for
    every checkpoint URL) is its own, the other keyword arguments go on to that class."""

    def __init__(self, *, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint_storage = Storage(storage_options)
        self._data = DataProgress()

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__} is used before Lightning connected the model.")
        return module

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A checkpoint is loaded by parameter name into the model as set-up cut it (stages, shards).
        return True

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        accumulate_as_scheduled(self._module.trainer)  # an epoch resumed mid-way ran no epoch-start hook
        warn_if_an_accumulated_step_was_cut(self._module.trainer)
        self._data.warn_if_epoch_restarts(self._module.trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self._data.epoch_started(self._module.trainer.current_epoch)

    def _end_run(self) -> pl.Trainer | None:
        """The end of a run, before a teardown of the strategy's own: the data position is final, and the callback
        hooks the run wrapped are theirs again. Returns the run's Trainer, if Lightning connected one."""
        self._data.fit_ended()
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            restore_callback_hooks(trainer)
        return trainer
