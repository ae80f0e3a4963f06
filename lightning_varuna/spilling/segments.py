"""A model cut at every CutPoint into segments, traced once per input shape and train/eval mode, whose segment
modules run the model's own parameters (wherever their data is at the time)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn

from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.partition.split import PipelineGraph, split_into_all_stages
from lightning_varuna.partition.trace_cache import trace_key, tracing_own_forward

__all__ = ["Segments"]


class Segments:
    """``module`` cut before each of ``cutpoints``: the segment modules for given inputs (traced on first use).

    The skeleton is taken now: later traces need only shapes, so they work while the parameters are spilled, or
    still on the meta device (their stand-ins then go to ``device``). Each trace runs inside ``tracing()``.
    """

    def __init__(
        self,
        module: nn.Module,
        cutpoints: list[str],
        device: torch.device | None = None,
        tracing: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.module, self.cutpoints, self.tracing = module, cutpoints, tracing
        self.skeleton = ModelSkeleton(module, meta_to=device)
        self._real: dict[str, Tensor] = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        self._traced: dict[tuple, tuple[PipelineGraph, list[nn.Module]]] = {}

    def for_inputs(self, args: tuple, kwargs: dict) -> tuple[PipelineGraph, list[nn.Module]]:
        """The graph and segment modules for inputs of this shape in the model's current train/eval mode."""
        key = trace_key(self.module, args, kwargs)
        if key not in self._traced:
            with self.tracing(), tracing_own_forward(self.module, args, kwargs) as (args, kwargs):
                graph, modules = split_into_all_stages(
                    self.module, self.skeleton, self._real, args, kwargs, self.cutpoints
                )
            for segment in modules:
                segment.train(self.module.training)
            self._traced[key] = (graph, modules)
        return self._traced[key]
