"""What the strategies that run a step's forward and backward themselves need of the module and the callbacks."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

__all__ = ["WEIGHT_AVERAGING", "require_automatic_optimization"]

# Lightning's callbacks that keep an average of every parameter of the model.
WEIGHT_AVERAGING = (StochasticWeightAveraging, WeightAveraging)


def require_automatic_optimization(module: pl.LightningModule, strategy: str, runs: str) -> None:
    """Refuse manual optimization: ``strategy`` ``runs`` (the step's forward and backward, its way) itself."""
    if not module.automatic_optimization:
        raise TypeError(
            f"`{type(module).__name__}.automatic_optimization = False`: {strategy} runs {runs} itself and needs "
            "Lightning's automatic optimization. Remove `automatic_optimization = False` (and `manual_backward`), "
            "return the loss from `training_step`, and set `gradient_clip_val` / `accumulate_grad_batches` on the "
            "Trainer."
        )
