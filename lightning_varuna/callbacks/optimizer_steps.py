"""`OptimizerSteps`: which of a fit's batch ends follow an optimizer step. A checkpoint holds no accumulated
gradients, so a callback that saves waits for the batch that ends a step accumulating several
(``accumulate_grad_batches``)."""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["OptimizerSteps"]


class OptimizerSteps:
    """Tells the batch ends that follow an optimizer step from those of batches that a step still accumulates."""

    def __init__(self) -> None:
        self._seen = 0  # the global step at the last call

    def started(self, trainer: pl.Trainer) -> None:
        """At the start of ``trainer``'s training (resumed or not): no step has run since."""
        self._seen = trainer.global_step

    def stepped(self, trainer: pl.Trainer) -> bool:
        """At a batch end: whether an optimizer step ran since the last call (or `started`)."""
        if trainer.global_step == self._seen:
            return False
        self._seen = trainer.global_step
        return True
