"""The one entry point that turns a model with CutPoints into this rank's pipeline stage."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_varuna.partition.balance import balance_stages
from lightning_varuna.partition.discovery import discover_cutpoints
from lightning_varuna.pipeline.shared_params import SharedParameters
from lightning_varuna.pipeline.stage import Stage
from lightning_varuna.pipeline.topology import PipelineGroups, Topology

__all__ = ["plan_stage"]


def plan_stage(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    topology: Topology,
    segment_costs: Callable[[list[str]], list[float]],
    device: torch.device,
    groups: PipelineGroups,
) -> Stage:
    """Cut ``module`` into ``topology.num_stages`` stages at the CutPoints that balance
    ``segment_costs(cutpoints)`` (seconds per segment, the same on every rank) and return this rank's `Stage`: traced
    for ``(args, kwargs)`` (one micro-batch), holding only its own tensors, its tied weights equal on every stage
    and replica. Collective: every rank calls it alike."""
    cutpoints = discover_cutpoints(module, args, kwargs)
    num_stages = topology.num_stages
    if num_stages > len(cutpoints) + 1:
        asked = f"`VarunaStrategy(pipeline_parallel_size={topology.pipeline_parallel_size})`"
        if topology.stages_per_rank > 1:
            asked = (
                f"`VarunaStrategy(pipeline_parallel_size={topology.pipeline_parallel_size}, "
                f"stages_per_rank={topology.stages_per_rank})` cuts {num_stages} stages and"
            )
        raise ValueError(
            f"{asked} needs at least {num_stages - 1} CutPoint(s) in "
            f"the forward, but `{type(module).__name__}` calls {len(cutpoints)}: {cutpoints} (one whose output is the "
            f"forward's output has no work after it and does not count). Use at most {len(cutpoints) + 1} stage(s) or "
            "add CutPoints between the model's layers."
        )
    boundaries: list[str] = []
    if num_stages > 1:
        starts = balance_stages(segment_costs(cutpoints), num_stages)
        boundaries = [cutpoints[start - 1] for start in starts[1:]]
    stage = Stage(module, boundaries, topology, device, groups.messages)
    graph, _ = stage.stage_for(args, kwargs)
    stage.release_other_stages(graph)
    stage.shared = SharedParameters(graph.stage_parameters, topology, dict(module.named_parameters()))
    stage.shared.broadcast_initial_values(groups.replicas)
    return stage
