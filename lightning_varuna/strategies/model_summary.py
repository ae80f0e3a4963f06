"""Lightning's model summary of the whole model, where this process holds only part of its tensors.

Lightning's `ModelSummary` callback (and `RichModelSummary`) counts the parameters the LightningModule holds: under
`SpillingStrategy` the spilled ones hold no elements, under `VarunaStrategy` a rank holds its stage's alone, so the
summary said "Trainable params: 0", or one stage's count. And with an ``example_input_array`` it runs the model on
that input for the layers' sizes, which fails on a model that is not whole here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary

from lightning_varuna.partition.skeleton import ModelSkeleton

__all__ = ["forget_whole_model_summaries", "summarize_whole_model"]


def summarize_whole_model(trainer: pl.Trainer, skeleton: ModelSkeleton) -> None:
    """Make ``trainer``'s model summaries count every parameter of the model ``skeleton`` describes: while one
    summarizes, every parameter and buffer has a memory-free stand-in of its shape. No example input
    (``example_input_array``) runs through the model then: the summary has no layer sizes or FLOPs."""
    for callback in _summaries(trainer):
        callback.on_fit_start = partial(  # type: ignore[method-assign]
            _summarize, type(callback).on_fit_start.__get__(callback), skeleton
        )


def forget_whole_model_summaries(trainer: pl.Trainer) -> None:
    """Give ``trainer``'s model summaries back their own behaviour (after `summarize_whole_model`)."""
    for callback in _summaries(trainer):
        vars(callback).pop("on_fit_start", None)


def _summaries(trainer: pl.Trainer) -> list[ModelSummary]:
    return [c for c in trainer.callbacks if isinstance(c, ModelSummary)]  # type: ignore[attr-defined]


def _summarize(
    on_fit_start: Callable[[pl.Trainer, pl.LightningModule], None],
    skeleton: ModelSkeleton,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
) -> None:
    example = pl_module.example_input_array
    pl_module.example_input_array = None
    try:
        with skeleton.stand_ins(pl_module):
            on_fit_start(trainer, pl_module)
    finally:
        pl_module.example_input_array = example
