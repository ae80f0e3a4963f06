"""A trial of an Optuna study, inside its model's Trainer: its ``monitor`` reported after each validation, pruned at
the next step boundary when the study's pruner says so, checkpointed now and then (at a step that validates, after the
value is reported: a retry resumed from a checkpoint of that step does not validate there again), and stopped with a
checkpoint at a step boundary when the sweep is preempted. A trial that another worker handed over (it heard from it
too late) ends at its next step boundary, neither reporting nor checkpointing again: its retry carries on from its
checkpoint."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_varuna._lightning_private import validates_as_scheduled
from lightning_varuna._optuna_private import frozen_trial
from lightning_varuna.callbacks.optimizer_steps import OptimizerSteps
from lightning_varuna.multimodel.pruning import next_decision, next_validation

__all__ = ["TrialCallback"]


class TrialCallback(pl.Callback):
    """Links one model's Trainer to its Optuna trial.

    Args:
        trial: the `optuna.trial.Trial` the model trains for.
        monitor: the logged value the study optimizes (``trainer.callback_metrics[monitor]``).
        checkpoint_url: where the trial's checkpoint goes (written again in place: the newest complete one counts).
        checkpoint_interval: seconds between the trial's checkpoints (taken at a step boundary), so that a worker
            that dies loses at most that much of it.
        preempted: set when the sweep must stop: the trial checkpoints at its next step boundary and ends.
        minimize: whether the study minimizes the value (for the best value).
    """

    def __init__(
        self,
        trial: Any,
        monitor: str,
        checkpoint_url: str,
        checkpoint_interval: float,
        preempted: threading.Event,
        minimize: bool,
    ) -> None:
        import optuna

        self.trial, self.monitor = trial, monitor
        self._told_already = optuna.exceptions.UpdateFinishedTrialError
        self.checkpoint_url, self.checkpoint_interval = checkpoint_url, checkpoint_interval
        self.preempted, self.minimize = preempted, minimize
        self.last: float | None = None
        self.best: float | None = None
        self.pruned = False
        self.interrupted = False  # stopped by the preemption, with a checkpoint
        self.handed_over = False  # told by another worker, which found it silent: it ends at its next step boundary
        self.reported_steps: set[int] = set()
        self.save_error: Exception | None = None  # why its last checkpoint could not be written
        self.logged_instead: list[str] | None = None  # what a validation without ``monitor`` had logged
        self._checkpointed_s = time.monotonic()
        self._save_after_validation = False  # the interval's checkpoint, due at a step that validates
        self._steps = OptimizerSteps()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._checkpointed_s = time.monotonic()
        self._steps.started(trainer)
        if self.handed_over:  # while it was built and set up: it ends before its first step
            _stop_without_validating(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or self.handed_over:
            return
        self._report(trainer)
        if self._save_after_validation and not (self.handed_over or self.pruned):
            self.save(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        """Report the validation's ``monitor`` to the trial, and stop the fit if the pruner says so."""
        logged = trainer.callback_metrics.get(self.monitor)
        if logged is None:  # (a value logged at epoch ends only may come later)
            if self.logged_instead is None:
                rank_zero_warn(
                    f"The study's `monitor={self.monitor!r}` is not among the values trial {self.trial.number} has "
                    f"logged after its validation at step {trainer.global_step}: {sorted(trainer.callback_metrics)}."
                )
            self.logged_instead = sorted(trainer.callback_metrics)
            return
        value = float(logged.item() if isinstance(logged, torch.Tensor) else logged)
        self.last = value
        self.keep_if_best(value)
        step = trainer.global_step
        if step not in self.reported_steps:  # Optuna keeps one value per step
            try:
                self.trial.report(value, step)
            except self._told_already:  # handed over since its last heartbeat: the retry reports from here
                self.handed_over = trainer.should_stop = True
                return
            self.reported_steps.add(step)
        if self.trial.should_prune():
            self.pruned = True
            trainer.should_stop = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._steps.stepped(trainer):
            return  # a batch that accumulates: not a step boundary
        if self.handed_over:  # set by its worker's heartbeat, which found it told
            _stop_without_validating(trainer)
        elif self.preempted.is_set() and not self.interrupted:
            self.interrupted = True
            self.save(trainer)
            if validates_as_scheduled(trainer):  # its value is reported (a resumed fit passes that validation over)
                trainer.should_stop = True
            else:
                _stop_without_validating(trainer)
        elif time.monotonic() - self._checkpointed_s >= self.checkpoint_interval:
            if validates_as_scheduled(trainer):  # after the value is reported: a fit resumed here skips the validation
                self._save_after_validation = True
            else:
                self.save(trainer)

    def save(self, trainer: pl.Trainer) -> None:
        """Checkpoint the trial now (its newest complete checkpoint is what a resumed trial continues from); but if
        another worker has handed it over meanwhile (it had not heard from it for too long), end it instead: its
        retry resumes from the checkpoint there, which a new save would replace while the retry reads it."""
        if frozen_trial(self.trial.study, self.trial.number).state.is_finished():
            self.handed_over = True
            _stop_without_validating(trainer)
            return
        try:
            trainer.save_checkpoint(self.checkpoint_url)
        except Exception as error:
            self.save_error = error
            raise
        self._checkpointed_s = time.monotonic()
        self._save_after_validation = False

    def keep_if_best(self, value: float) -> None:
        """Keep ``value`` as the trial's best reported ``monitor`` if it is (a number, and better)."""
        if math.isfinite(value) and (self.best is None or (value < self.best if self.minimize else value > self.best)):
            self.best = value

    def next_decision(self, trainer: pl.Trainer) -> tuple[float, float]:
        """The global step of the study's pruner's next decision on the trial, and the share of trials that go on
        past it (`lightning_varuna.multimodel.pruning`)."""
        validation, every = next_validation(trainer, trainer.global_step)
        return next_decision(self.trial.study.pruner, trainer.global_step, validation, every)

    def value(self, which: str) -> float | None:
        """The trial's value: its ``"last"`` or ``"best"`` reported ``monitor``."""
        return self.best if which == "best" else self.last


def _stop_without_validating(trainer: pl.Trainer) -> None:
    """End the fit at this step boundary. Lightning validates once more when a fit is stopped mid-epoch; a trial that
    stops for its retry to carry on neither reports that value (off the validation schedule, it would reach the
    pruner and the retry's history) nor spends the preemption's notice on it. (The Trainer trains no more.)"""
    trainer.should_stop = True
    trainer.limit_val_batches = 0
