"""The first batch of the loop a Trainer is about to run, the step that loop calls, and what that step passes to
``self(...)``: what a strategy traces and measures the model with before the first step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler

from lightning_varuna.data.microbatch import batch_size_of, per_sample_items, split_microbatches, unsplit_leaves
from lightning_varuna.pipeline.step import capture_forward_inputs
from lightning_varuna.random_states import global_random_states_kept

__all__ = ["STEP_OF_FN", "FirstBatch", "first_batch", "first_batch_of_loaders", "first_forward_inputs"]

STEP_OF_FN = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


@dataclass(frozen=True)
class FirstBatch:
    """`first_batch`, the number of DataLoaders whose batches it combines, and how many samples the first DataLoader
    collated into it (None where its batch sampler is not torch's `BatchSampler`, see `_samples_in_first_batch`)."""

    batch: Any
    loaders: int
    samples: int | None = None


def first_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the loop ``trainer`` runs now (fit, validate, test or predict), as the loop prepares a batch
    before `batch_to_device`: a batch of each DataLoader for a training step over several (combined as the loop
    combines them), the first DataLoader's otherwise; converted by the precision plugin (``precision="64-true"``
    makes its floats doubles) and passed through ``on_before_batch_transfer``."""
    return first_batch_of_loaders(trainer).batch


def first_forward_inputs(
    trainer: pl.Trainer, first: FirstBatch, batch_to_device: Callable[[Any], Any], micro_batch_size: int
) -> tuple[tuple, dict]:
    """The forward arguments of the first micro-batch of ``micro_batch_size`` rows of ``first`` (moved by
    ``batch_to_device``): what the loop's first step passes to ``self(...)`` (which also checks that the step calls
    it; ``example_input_array`` would not). A batch that holds its samples as a list is refused, and a training
    batch combined from several DataLoaders where it would be split."""
    batch, loaders = batch_to_device(first.batch), first.loaders
    rows = batch_size_of(batch)
    _refuse_samples_listed(batch, rows, first.samples)
    microbatches = split_microbatches(batch, micro_batch_size)
    if len(microbatches) > 1:
        _check_rows_split(batch, rows, loaders, first.samples, micro_batch_size)
    assert trainer.state.fn is not None
    return capture_forward_inputs(trainer.lightning_module, STEP_OF_FN[trainer.state.fn], microbatches[0])


def _refuse_samples_listed(batch: Any, rows: int, samples: int | None) -> None:
    """Refuse a batch that holds its ``samples`` as a list of tensors (or dicts) while its first tensor's dim 0
    (``rows``) is not the number of samples: VarunaStrategy takes that dim 0 as the batch's rows, and would cut each
    sample's tensor into micro-batches (a sequence's tokens: trained on, silently, in pieces)."""
    listed = per_sample_items(batch, samples) if samples is not None and samples != rows else None
    if listed is not None:
        raise ValueError(
            f"`batch{listed}` holds the batch's {samples} samples as a list, one tensor or dict each (as detection "
            f"models take images and targets), but VarunaStrategy takes a batch's rows from its first tensor's dim 0 "
            f"({rows} here) to split it into micro-batches and to check what crosses a CutPoint: it would cut each "
            "sample's tensor instead. Collate the samples into tensors with the batch in dim 0 (pad the sequences, "
            "or bring the images to one size, and stack them)."
        )


def _check_rows_split(batch: Any, rows: int, loaders: int, samples: int | None, micro_batch_size: int) -> None:
    """Refuse a batch of several DataLoaders, which `split_microbatches` would split by the first one's rows; warn of
    a first tensor whose ``rows`` are not the DataLoader's ``samples`` (a sequence-first batch), and of tensors given
    whole to every micro-batch."""
    if loaders > 1:
        raise ValueError(
            f"This fit trains on {loaders} DataLoaders combined (a batch of each per step), but VarunaStrategy "
            f"splits each batch into micro-batches of `micro_batch_size={micro_batch_size}` rows of its first "
            "tensor, which would give every micro-batch the whole batch of the others. Train on one DataLoader "
            "(a Dataset that returns the pair), or pass a `micro_batch_size` of the whole batch (one micro-batch)."
        )
    if samples is not None and rows != samples:
        rank_zero_warn(
            f"VarunaStrategy splits the batch into micro-batches of `micro_batch_size={micro_batch_size}` rows along "
            f"its first tensor's dim 0 ({rows} rows), but the DataLoader collated {samples} samples into it. Right if "
            "each sample makes several rows; if dim 0 is not the batch (a sequence-first batch of shape (tokens, "
            "batch)), put the batch in dim 0 and transpose it in the model."
        )
    unsplit = unsplit_leaves(batch)
    if unsplit:
        rank_zero_warn(
            f"VarunaStrategy gives `batch{unsplit[0]}` whole to every micro-batch: its dim 0 is not the batch size "
            f"({rows}, the rows of the batch's first tensor). Right for a table every row reads; "
            "if it holds rows of the batch, make the batch size its dim 0 or pass a `micro_batch_size` of the whole "
            "batch."
        )


def first_batch_of_loaders(trainer: pl.Trainer) -> FirstBatch:
    """`first_batch` with the number of DataLoaders it combines. Each call reads the loaders again (and calls a
    ``train_dataloader`` hook again): read it once per set-up."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }[trainer.state.fn]  # type: ignore[index]
    loaders = loop._data_source.dataloader()  # type: ignore[attr-defined]
    if not isinstance(loaders, CombinedLoader):  # as the loop combines them (an evaluation loop: one after another)
        loaders = CombinedLoader(loaders, "max_size_cycle" if fitting else "sequential")
    with _random_numbers_kept(loaders.flattened):
        batch, _, _ = next(iter(loaders))
    samples = _samples_in_first_batch(loaders.flattened[0])
    batch = trainer.precision_plugin.convert_input(batch)
    combined = len(loaders.flattened) if fitting else 1  # an evaluation step reads one DataLoader's batch
    return FirstBatch(trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0), combined, samples)


def _samples_in_first_batch(loader: Any) -> int | None:
    """How many samples ``loader`` collates into its first batch, where its batch sampler is torch's fixed-size
    `BatchSampler` (a batch of ``batch_size``, fewer if the sampler has fewer); None otherwise (a batch sampler of
    one's own may make batches of any size, and is not read ahead)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if type(batch_sampler) is not BatchSampler:
        return None
    try:
        samples = min(batch_sampler.batch_size, len(batch_sampler.sampler))  # type: ignore[arg-type]
    except TypeError:  # a sampler without a length
        return None
    return samples or None


@contextmanager
def _random_numbers_kept(loaders: list[Any]) -> Iterator[None]:
    """Iterating a DataLoader draws from its generator (or torch's global one) and its sampler's, and a dataset's
    augmentations from Python's and NumPy's global ones: give them all back their states, so that the loop then
    reads the batches in the order, and augmented as, it would have without this look ahead."""
    owners = []
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        owners += [loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)]
    generators = {id(g): g for g in (getattr(o, "generator", None) for o in owners) if isinstance(g, torch.Generator)}
    states = [(generator, generator.get_state()) for generator in generators.values()]
    with global_random_states_kept():
        yield
    for generator, state in states:
        generator.set_state(state)
