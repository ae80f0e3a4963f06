"""Run the LightningModule's epoch-end hooks where a pipelined step keeps its state: on the last stage.

Only the last stage runs the code of a step that comes after ``self(...)``, so what the steps keep for the epoch's
end (outputs appended to a list, a metric they update) is the last stage's alone: on the other stages the list is
empty. The module's own epoch-end hooks (``on_train_epoch_end``, ``on_validation_epoch_end``, ...) run on the last
stage only; the values they log are sent to the replica's other stages and logged on every stage, as a step's are
(`step_logging`), so that rank 0's loggers, the checkpoint monitors and a ``sync_dist`` reduction see them
everywhere. What the hook gathers itself (``self.all_gather``, a torchmetrics metric's ``compute()``) is gathered
over the last stages of the replicas (``inside``), which hold all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torchmetrics import Metric

from lightning_varuna.pipeline.step_logging import LogRecorder, replay

__all__ = ["EPOCH_END_HOOKS", "LastStageEpochEnds", "metrics_synced_over"]

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end", "on_predict_epoch_end")


class LastStageEpochEnds:
    """Makes the epoch-end hooks that ``module`` overrides run as the module docstring says, until `restore`.

    Args:
        module: the LightningModule.
        is_last_stage: whether this rank holds the last stage.
        inside: a context for the hook on the last stage (collectives over the last stages).
        exchange: on the last stage, sends what it is given to the other stages and returns it; elsewhere,
            returns what the last stage sent.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        is_last_stage: bool,
        inside: Callable[[], AbstractContextManager[Any]],
        exchange: Callable[[Any], Any],
    ) -> None:
        self.module, self.is_last_stage, self.inside, self.exchange = module, is_last_stage, inside, exchange
        for name in EPOCH_END_HOOKS:
            if is_overridden(name, module):
                setattr(module, name, _OnLastStage(self, getattr(type(module), name).__get__(module)))

    def run(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` on the last stage, recording what it logs; log that on every stage."""
        summary = None
        if self.is_last_stage:
            recorder = LogRecorder(training=False)  # an epoch-end hook logs for the epoch by default
            with recorder.capture(self.module), self.inside():
                hook()
            summary = recorder.summary()
        replay(self.module, self.exchange(summary), self.module.device)

    def restore(self) -> None:
        """Give the module its own hooks back."""
        for name in [name for name, value in vars(self.module).items() if isinstance(value, _OnLastStage)]:
            delattr(self.module, name)


class _OnLastStage:
    """A module's own epoch-end hook, run by `LastStageEpochEnds`."""

    def __init__(self, owner: LastStageEpochEnds, hook: Callable[[], None]) -> None:
        self.owner, self.hook = owner, hook

    def __call__(self) -> None:
        self.owner.run(self.hook)


@contextmanager
def metrics_synced_over(module: pl.LightningModule, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Inside, the torchmetrics metrics of ``module`` gather their state over ``group`` when computed."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    before = [m.process_group for m in metrics]
    for metric in metrics:
        metric.process_group = group
    try:
        yield
    finally:
        for metric, group_before in zip(metrics, before, strict=True):
            metric.process_group = group_before
