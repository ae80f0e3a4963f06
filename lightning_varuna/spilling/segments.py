"""The segments a spilled model runs shard by shard: the model cut at every CutPoint (traced once per input shape and
train/eval mode), or, when it fits the device in one shard, the whole model run by its own forward, uncut. Either
way the segment modules run the model's own parameters (wherever their data is at the time)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.partition.split import PipelineGraph, Source, split_into_all_stages
from lightning_varuna.partition.trace_cache import Traces, trace_key, tracing_own_forward

__all__ = ["Segments", "WholeModel"]


class Segments:
    """``module`` cut before each of ``cutpoints``: the segment modules for given inputs (traced on first use).

    The skeleton is taken now: later traces need only shapes, so they work while the parameters are spilled, or
    still on the meta device; their stand-ins go to ``device``, where the segments run. Each trace runs inside
    ``tracing()``.
    """

    def __init__(
        self,
        module: nn.Module,
        cutpoints: list[str],
        device: torch.device | None = None,
        tracing: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.module, self.cutpoints, self.tracing = module, cutpoints, tracing
        self.skeleton = ModelSkeleton(module, device=device)
        self._real: dict[str, Tensor] = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        self._traced: Traces[tuple[PipelineGraph, list[nn.Module]]] = Traces(f"`{type(module).__name__}`")

    def for_inputs(self, args: tuple, kwargs: dict) -> tuple[PipelineGraph, list[nn.Module]]:
        """The graph and segment modules for inputs of this shape in the model's current train/eval mode."""
        return self._traced.get(trace_key(self.module, args, kwargs), lambda: self._trace(args, kwargs))

    def _trace(self, args: tuple, kwargs: dict) -> tuple[PipelineGraph, list[nn.Module]]:
        with self.tracing(), tracing_own_forward(self.module, args, kwargs) as (args, kwargs):
            graph, modules = split_into_all_stages(self.module, self.skeleton, self._real, args, kwargs, self.cutpoints)
        for segment in modules:
            segment.train(self.module.training)
        return graph, modules


class WholeModel:
    """``module`` as one segment that runs its own forward (no trace): the `Segments` of a model that fits the
    device in one shard. Its output is one value, whatever its structure (which may differ by arguments)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self._forward = module, module.forward  # its own forward, not one a step patches on later
        self._params = {name for name, _ in module.named_parameters()}
        self._buffers = {name for name, _ in module.named_buffers()}
        self._by_inputs: dict[TreeSpec, tuple[PipelineGraph, list[nn.Module]]] = {}

    def for_inputs(self, args: tuple, kwargs: dict) -> tuple[PipelineGraph, list[nn.Module]]:
        """The one-segment graph and its module for inputs of this structure."""
        leaves, spec = tree_flatten((args, kwargs))
        if spec not in self._by_inputs:
            inputs = [Source(None, i) for i in range(len(leaves))]
            # The outputs' shapes are what running the model gives: nothing is sent between stages here.
            graph = PipelineGraph([inputs], [[]], [Source(0, 0)], [self._params], _ONE_VALUE, [self._buffers])
            self._by_inputs[spec] = (graph, [_OwnForward(self, spec)])
        return self._by_inputs[spec]

    def run(self, args: tuple, kwargs: dict) -> object:
        """The model's output for these inputs, from its own forward: as on one device, a Hugging Face model's
        key/value cache included (where a cut model computes none: its attention then rounds otherwise)."""
        return self._forward(*args, **kwargs)


_, _ONE_VALUE = tree_flatten(0)  # the structure of a single value


class _OwnForward(nn.Module):
    """Run ``whole``'s model on the leaves of inputs of structure ``input_spec``; return its output as the one value
    of a tuple."""

    def __init__(self, whole: WholeModel, input_spec: TreeSpec) -> None:
        super().__init__()
        self.model, self._whole, self._input_spec = whole.module, whole, input_spec

    def forward(self, *leaves: object) -> tuple:
        args, kwargs = tree_unflatten(list(leaves), self._input_spec)
        return (self._whole.run(args, kwargs),)
