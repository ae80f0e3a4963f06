"""Lightning's model summary of the whole model, where this process holds only part of its tensors.

Lightning's `ModelSummary` callback (and `RichModelSummary`) counts the parameters the LightningModule holds: under
`SpillingStrategy` the spilled ones hold no elements, under `VarunaStrategy` a rank holds its stage's alone, so the
summary said "Trainable params: 0", or one stage's count. And with an ``example_input_array`` it runs the model on
that input for the layers' sizes, which fails on a model that is not whole here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary

from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.strategies.callback_hooks import run_hook_inside

__all__ = ["summarize_whole_model"]


def summarize_whole_model(trainer: pl.Trainer, skeleton: ModelSkeleton) -> None:
    """Make ``trainer``'s model summaries count every parameter of the model ``skeleton`` describes: while one
    summarizes, every parameter and buffer has a memory-free stand-in of its shape. No example input
    (``example_input_array``) runs through the model then: the summary has no layer sizes or FLOPs. Undone by
    `restore_callback_hooks`."""
    run_hook_inside(trainer, ModelSummary, "on_fit_start", lambda pl_module: _whole(skeleton, pl_module))


@contextmanager
def _whole(skeleton: ModelSkeleton, pl_module: pl.LightningModule) -> Iterator[None]:
    example = pl_module.example_input_array
    pl_module.example_input_array = None
    try:
        with skeleton.stand_ins(pl_module):
            yield
    finally:
        pl_module.example_input_array = example
