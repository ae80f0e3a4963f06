"""One rank's pipeline stage: the model traced and cut at the chosen CutPoints, the stage module this rank runs (one per
stage it holds, under an interleaved schedule), its runtime, and the parameters it shares with other stages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.partition.released import guard_released
from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.partition.split import PipelineGraph, split_into_rank_stages
from lightning_varuna.partition.trace_cache import Traces, trace_key, tracing_own_forward
from lightning_varuna.pipeline.runtime import StageRuntime
from lightning_varuna.pipeline.shared_params import SharedParameters
from lightning_varuna.pipeline.topology import Topology

__all__ = ["Stage"]


class Stage:
    """This rank's pipeline stage of a model cut at ``boundaries``: the traced stage module per input shape, the
    runtime that runs it, and the parameters it shares with other stages. Under an interleaved schedule the rank holds
    several stages (``topology.stage_indices``): a stage module each, one runtime, the tensors of all of them.

    Args:
        module: the whole model; after `release_other_stages` it holds only this stage's tensors.
        boundaries: the CutPoints where stages 1, 2, ... begin.
        topology: this rank's place in the pipeline x data-parallel layout.
        device: where received activations and gradients are put.
        message_groups: the process groups of this replica's activations and gradients (see `StageRuntime`).
    """

    def __init__(
        self,
        module: nn.Module,
        boundaries: list[str],
        topology: Topology,
        device: torch.device,
        message_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
    ) -> None:
        self.module = module
        self.boundaries = boundaries
        self.stage_indices = topology.stage_indices
        self._num_stages = topology.num_stages
        self.skeleton = ModelSkeleton(module)
        self._real = dict(_named_tensors(module))
        self._traced: Traces[tuple[PipelineGraph, dict[int, nn.Module]]] = Traces(f"`{type(module).__name__}`")
        self.runtime = StageRuntime(topology.stage_indices, topology.ranks_of_stages(), device, message_groups)
        self.shared: SharedParameters
        self._own_parameters: list[Tensor] | None = None
        self._unused_parameters: set[int] = set()  # ids of the parameters no stage uses

    @property
    def stage_index(self) -> int:
        """The rank's first stage (with one stage per rank: its stage)."""
        return self.stage_indices[0]

    def stage_for(self, args: tuple, kwargs: dict, stage: int | None = None) -> tuple[PipelineGraph, nn.Module]:
        """The traced ``stage`` (default: the rank's first) for inputs of this shape and the module's train/eval mode
        (traced once each)."""
        graph, modules = self._traced.get(trace_key(self.module, args, kwargs), lambda: self._trace(args, kwargs))
        return graph, modules[self.stage_index if stage is None else stage]

    def _trace(self, args: tuple, kwargs: dict) -> tuple[PipelineGraph, dict[int, nn.Module]]:
        with tracing_own_forward(self.module, args, kwargs) as (args, kwargs):
            graph, modules = split_into_rank_stages(
                self.module, self.skeleton, self._real, args, kwargs, self.boundaries, self.stage_indices
            )
        for stage_module in modules.values():
            stage_module.train(self.module.training)
        return graph, modules

    def release_other_stages(self, graph: PipelineGraph) -> None:
        """Free the parameters and buffers that this rank's stages do not use. Those no stage uses (a frozen copy
        kept beside what replaced it, a table computed once) stay with the first stage, which saves them."""
        used = [params | buffers for params, buffers in zip(graph.stage_parameters, graph.stage_buffers, strict=True)]
        keep = set().union(*(used[s] for s in self.stage_indices))
        unused = self.skeleton.tensor_names - set().union(*used)
        if 0 in self.stage_indices:
            keep = keep | unused
        released = self.skeleton.release(self.module, keep)
        guard_released(self.module, released, f"stage {', '.join(map(str, self.stage_indices))} of {self._num_stages}")
        self._real = {name: t for name, t in self._real.items() if name in keep}
        self._own_parameters = None
        self._unused_parameters = {id(t) for name, t in self._real.items() if name in unused}

    def released_slots_filled(self, device: torch.device) -> AbstractContextManager[None]:
        """Memory-free stand-ins on ``device`` where this rank released another stage's tensors, while the module
        moves: a module's own ``_apply`` may read one (timm's rotary embedding)."""
        return self.skeleton.stand_ins(self.module, missing_only=True, device=device)

    def own_parameters(self) -> list[Tensor]:
        """The parameters this rank holds (after `release_other_stages`: its stage's)."""
        if self._own_parameters is None:
            self._own_parameters = list(self.module.parameters())
        return self._own_parameters

    def trained_parameters(self) -> list[Tensor]:
        """The parameters of this rank's stage that take gradients: not frozen ones, nor those no stage uses (kept
        by the first stage), which on one device keep no gradient. (One frozen while its gradients accumulate over
        batches keeps them until the step.)"""
        return [
            p
            for p in self.own_parameters()
            if (p.requires_grad or p.grad is not None) and id(p) not in self._unused_parameters
        ]


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()
