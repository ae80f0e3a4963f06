"""A stage's backward in two parts (zero-bubble): the gradients of its inputs now, for the previous stage that waits
for them, and its parameters' gradients later, where the stage would otherwise wait. torch's own split runs both
parts (`stage_backward_input` / `stage_backward_weight`, as its zero-bubble schedules do); this module decides when a
stage can use it and does the whole backward in one part where it cannot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn

from lightning_varuna._torch_private import (
    construct_reverse_graph,
    grad_node,
    reverse_closure,
    stage_backward_input,
    stage_backward_weight,
)

__all__ = ["SplitBackward"]

WeightPass = Callable[[], None]


class SplitBackward:
    """Splits the backwards of stage modules, remembering per module whether torch's split reaches every parameter."""

    def __init__(self) -> None:
        self._exact: WeakKeyDictionary[nn.Module, bool] = WeakKeyDictionary()

    def input_part(
        self, module: nn.Module, outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]
    ) -> WeightPass:
        """Back-propagate ``grads`` of ``outputs`` (computed by ``module``) into the ``.grad`` of ``inputs`` (the
        received tensors that require gradients); return the weight pass, which adds the parameters' gradients.

        torch splits the graph at the nodes where the parameters' paths join the inputs' paths; a parameter with a path
        to the outputs that joins no input's (every path, where no input needs a gradient, as on the first stage; or
        a parameter that reaches an output on its own) would miss that path's gradient in its weight part. Then: with
        no input to send a gradient to, the weight pass runs the whole backward (as torch's schedules do on their first
        stage); else this runs it whole now, and the weight pass does nothing.
        """
        if not outputs:
            return _nothing
        if not inputs:
            return lambda: torch.autograd.backward(outputs, grads)
        weights = [p for p in module.parameters() if p.requires_grad]
        if module not in self._exact:
            self._exact[module] = _split_reaches_every_parameter(outputs, inputs, weights)
        if not self._exact[module]:
            torch.autograd.backward(outputs, grads)
            return _nothing
        # torch detaches the outputs in place to free the graph's output side, which a view refuses (and which would
        # take a received tensor sent on as it came out of the graph).
        outputs = [t.clone() if t._is_view() or t.is_leaf else t for t in outputs]
        _, param_groups = stage_backward_input(list(outputs), list(grads), list(inputs), iter(weights))
        return lambda: _weight_part(weights, param_groups)


def _weight_part(weights: list[nn.Parameter], param_groups: list[dict]) -> None:
    # Each group of parameters takes its gradients in a backward of its own, and two groups may share the part of the
    # graph below the nodes where they meet the inputs' paths (T5's decoder: its embedding and self-attention before
    # the cross-attention reads the encoder's output). Freed by the first, it would fail the second: the graph is kept
    # until the weight pass ends, and freed with it.
    stage_backward_weight(iter(weights), param_groups, retain_graph=True)


def _nothing() -> None:
    return None


def _split_reaches_every_parameter(
    outputs: Sequence[Tensor], inputs: Sequence[Tensor], weights: Sequence[Tensor]
) -> bool:
    """Whether every path from the outputs back to a parameter passes through a node that an input reaches (where
    torch's split hands the parameters' gradients over to the weight part). The walks `stage_backward_input` makes,
    made once per stage module: its graph is the same for every micro-batch."""
    roots = {node for node in map(grad_node, outputs) if node is not None}
    reverse = construct_reverse_graph(list(roots))
    reached = [node for node in map(grad_node, weights) if node is not None and node in reverse]
    inputs_closure, _ = reverse_closure([node for node in map(grad_node, inputs) if node is not None], set(), reverse)
    # Walked forward from a parameter, stopping at the inputs' nodes: an output reached is a path around the split.
    return not any(reverse_closure([node], inputs_closure, reverse)[0] & roots for node in reached)
