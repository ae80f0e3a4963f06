"""The first batch of the loop a Trainer is about to run, the step that loop calls, and what that step passes to
``self(...)``: what a strategy traces and measures the model with before the first step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_varuna.data.microbatch import split_microbatches
from lightning_varuna.pipeline.step import capture_forward_inputs
from lightning_varuna.random_states import global_random_states_kept

__all__ = ["STEP_OF_FN", "first_batch", "first_forward_inputs"]

STEP_OF_FN = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


def first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the first DataLoader of the loop ``trainer`` runs now (fit, validate, test or predict), as
    the loop prepares a batch before `batch_to_device`: converted by the precision plugin (``precision="64-true"``
    makes its floats doubles) and passed through ``on_before_batch_transfer``."""
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }[trainer.state.fn]  # type: ignore[index]
    loaders = loop._data_source.dataloader()  # type: ignore[attr-defined]
    loader = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders
    loader = loader[0] if isinstance(loader, (list, tuple)) else loader
    with _random_numbers_kept(loader):
        batch = trainer.precision_plugin.convert_input(next(iter(loader)))
    return trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)


def first_forward_inputs(
    trainer: pl.Trainer, batch_to_device: Callable[[Any], Any], micro_batch_size: int
) -> tuple[tuple, dict]:
    """The forward arguments of the first micro-batch of ``micro_batch_size`` rows of `first_batch` (moved by
    ``batch_to_device``): what the loop's first step passes to ``self(...)`` (which also checks that the step calls
    it; ``example_input_array`` would not)."""
    microbatch = split_microbatches(batch_to_device(first_batch(trainer)), micro_batch_size)[0]
    assert trainer.state.fn is not None
    return capture_forward_inputs(trainer.lightning_module, STEP_OF_FN[trainer.state.fn], microbatch)


@contextmanager
def _random_numbers_kept(loader: Any) -> Iterator[None]:
    """Iterating a DataLoader draws from its generator (or torch's global one) and its sampler's, and a dataset's
    augmentations from Python's and NumPy's global ones: give them all back their states, so that the loop then
    reads the batches in the order, and augmented as, it would have without this look ahead."""
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, sampler, batch_sampler, getattr(batch_sampler, "sampler", None))
    generators = {id(g): g for g in (getattr(o, "generator", None) for o in owners) if isinstance(g, torch.Generator)}
    states = [(generator, generator.get_state()) for generator in generators.values()]
    with global_random_states_kept():
        yield
    for generator, state in states:
        generator.set_state(state)
