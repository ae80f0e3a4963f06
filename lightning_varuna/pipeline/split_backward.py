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
        disjoint = _disjoint(param_groups)
        return lambda: _weight_part(weights, disjoint)


def _weight_part(weights: list[nn.Parameter], param_groups: list[dict]) -> None:
    # Each group takes its gradients in a backward of its own; groups can still meet below their nodes (T5's decoder),
    # where the first would free what the second needs. The graph is kept until the pass ends, and freed with it.
    stage_backward_weight(iter(weights), param_groups, retain_graph=True)


def _disjoint(param_groups: list[dict]) -> list[dict]:
    """torch's parameter groups (each parameter's nodes where its paths meet the inputs', with their gradients from
    the input part) merged until no two share a parameter or a node.

    torch groups the parameters by those nodes, but a parameter that meets two groups' nodes merges the first into
    the second and leaves the first in the list too (T5's decoder, whose embedding and self-attention meet the
    encoder's output at several places): that parameter then took its gradient twice, in the order the nodes came out
    of a set (a weight 2e-5 off in float64, differing run to run), or the second backward found the graph the first
    had freed ("backward through the graph a second time")."""
    merged: list[tuple[set, dict]] = []
    for group in param_groups:
        params, nodes = set(group["params"]), dict(zip(group["intermediates"], group["grads"]))
        for other in [m for m in merged if m[0] & params or m[1].keys() & nodes.keys()]:
            merged.remove(other)
            params, nodes = params | other[0], {**other[1], **nodes}
        merged.append((params, nodes))
    return [{"params": params, "intermediates": list(nodes), "grads": list(nodes.values())} for params, nodes in merged]


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
