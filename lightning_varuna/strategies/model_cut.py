"""How `VarunaStrategy` cuts the model as a run sets up: the default micro-batch size (which sets the shapes the model
is traced with), then this rank's stage at the CutPoints that balance the segments' costs (`plan_stage`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_varuna.data.microbatch import batch_size_of, default_micro_batch_size, microbatch_sizes
from lightning_varuna.pipeline.batch_norm import normalizes_over_the_batch, one_value_per_channel_refused
from lightning_varuna.pipeline.shared_params import tie_weights
from lightning_varuna.pipeline.stage import Stage
from lightning_varuna.pipeline.stage_plan import plan_stage
from lightning_varuna.pipeline.topology import PipelineGroups, Topology
from lightning_varuna.profiling.model_costs import ModelCosts
from lightning_varuna.random_states import global_random_states_kept
from lightning_varuna.strategies.first_batch import FirstBatch, first_forward_inputs

__all__ = ["cut_model", "default_micro_batch_size_of"]


def default_micro_batch_size_of(
    trainer: pl.Trainer, first: Callable[[], FirstBatch], topology: Topology, global_batch_size: int | None
) -> int:
    """The default ``micro_batch_size``: from the replica's batch (its share of ``global_batch_size``, or the loop's
    first batch, read by ``first``) and the number of stages; logged."""
    num_stages = topology.pipeline_parallel_size
    if global_batch_size is not None:
        rows = global_batch_size // topology.data_parallel_size
    else:
        rows = batch_size_of(first().batch)
    min_rows = 2 if normalizes_over_the_batch(trainer.lightning_module) else 1  # BatchNorm cannot train on one row
    micro_batch_size = default_micro_batch_size(rows, num_stages, min_rows)
    count = len(microbatch_sizes(rows, micro_batch_size))
    rank_zero_info(
        f"VarunaStrategy: micro_batch_size={micro_batch_size} ({count} micro-batch(es) of the batch of {rows} "
        f"rows for {num_stages} stage(s)); pass `micro_batch_size=` to choose another."
    )
    return micro_batch_size


def cut_model(
    trainer: pl.Trainer,
    first: Callable[[], FirstBatch],
    topology: Topology,
    groups: PipelineGroups,
    costs: ModelCosts,
    micro_batch_size: int,
    shared_weights: list[tuple[str, str]],
) -> Stage:
    """This rank's stage of ``trainer``'s module on its strategy's device, with ``shared_weights`` tied first,
    traced with the first micro-batch of the loop's first batch (``first``) and cut where ``costs`` balance the
    stages; the cut is logged. Collective."""
    module, strategy = trainer.lightning_module, trainer.strategy
    tie_weights(module, shared_weights)
    per_node = trainer.num_devices  # processes
    advice = f"Pass `VarunaStrategy(micro_batch_size=2)` or more (it is {micro_batch_size})."
    # Moving the first batch (its `on_after_batch_transfer`: an augmentation), measuring and tracing (the model's
    # dropout) draw random numbers: give them back, so that the run then draws what one device would.
    with global_random_states_kept(strategy.root_device):
        args, kwargs = first_forward_inputs(trainer, first(), strategy.batch_to_device, micro_batch_size)
        segment_costs = partial(
            costs.segment_costs, module, args, kwargs, micro_batch_size=micro_batch_size, processes_per_node=per_node
        )
        with one_value_per_channel_refused(module, advice):
            stage = plan_stage(module, args, kwargs, topology, segment_costs, strategy.root_device, groups)
    cut = f"cut at CutPoints {stage.boundaries}" if stage.boundaries else "not cut"
    placement = "in a V" if topology.v_shape else "round-robin"
    per_rank = f" ({topology.stages_per_rank} per rank, {placement})" if topology.stages_per_rank > 1 else ""
    rank_zero_info(f"VarunaStrategy: {topology.num_stages} stage(s){per_rank}, {cut}")
    if normalizes_over_the_batch(module):
        rank_zero_info(
            f"VarunaStrategy: batch normalization sees one micro-batch ({micro_batch_size} rows) at a time, "
            "as in GPipe; every replica keeps the first replica's running statistics, as DDP does."
        )
    return stage
