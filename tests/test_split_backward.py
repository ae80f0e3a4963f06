"""A stage's backward in two parts (zero-bubble) gives the gradients of one backward, whatever the stage's graph."""

from __future__ import annotations

import torch
from torch import nn

from lightning_varuna.pipeline.split_backward import SplitBackward, _disjoint


class Block(nn.Module):
    """Two layers, the first weight used twice (a tied weight within one stage); the outputs: a view of the hidden
    state, and optionally a value that a parameter reaches without the input."""

    def __init__(self, alone: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.offset = nn.Parameter(torch.randn(4))
        self.alone = alone

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.a(x))
        h = self.b(h) + h @ self.a.weight
        out = (h + self.offset).view(-1)
        return (out, self.offset * 3.0) if self.alone else (out,)


def run(module: nn.Module, x: torch.Tensor, split: SplitBackward | None) -> tuple[torch.Tensor | None, dict]:
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    outputs = module(x)
    grads = [torch.linspace(-1, 1, o.numel()).view_as(o) for o in outputs]
    if split is None:
        torch.autograd.backward(outputs, grads)
    else:
        weight_pass = split.input_part(module, outputs, grads, [x] if x.requires_grad else [])
        input_grad = None if x.grad is None else x.grad.clone()
        assert all(p.grad is None for p in module.parameters()) or module.alone  # weights wait (unless unsplittable)
        weight_pass()
        assert x.grad is None or torch.equal(x.grad, input_grad)  # the weight pass adds nothing to the inputs'
    return x.grad, {name: p.grad.clone() for name, p in module.named_parameters()}


def assert_same_as_one_backward(module: nn.Module, x: torch.Tensor, split: SplitBackward) -> None:
    input_grad, weight_grads = run(module, x, None)
    split_input_grad, split_weight_grads = run(module, x, split)
    if input_grad is None:
        assert split_input_grad is None
    else:
        torch.testing.assert_close(split_input_grad, input_grad, rtol=1e-6, atol=1e-7)
    assert weight_grads.keys() == split_weight_grads.keys()
    for name, grad in weight_grads.items():
        torch.testing.assert_close(split_weight_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_two_parts_give_the_gradients_of_one_backward():
    torch.manual_seed(0)
    split = SplitBackward()
    module = Block()
    for _ in range(2):  # the second micro-batch takes the module's remembered verdict
        assert_same_as_one_backward(module, torch.randn(3, 4, requires_grad=True), split)


def test_a_stage_without_inputs_that_take_gradients_runs_its_whole_backward_in_the_weight_pass():
    torch.manual_seed(0)
    assert_same_as_one_backward(Block(), torch.randn(3, 4), SplitBackward())


def test_a_parameter_reaching_an_output_without_the_input_still_gets_its_gradient():
    """torch's split would leave out a parameter whose path never joins the input's: that stage runs its backward
    whole in the input part."""
    torch.manual_seed(0)
    split = SplitBackward()
    module = Block(alone=True)
    for _ in range(2):
        assert_same_as_one_backward(module, torch.randn(3, 4, requires_grad=True), split)


def test_parameter_groups_that_share_a_parameter_or_a_node_become_one():
    """torch's grouping can leave one parameter in two groups (T5's decoder): each would take its gradient twice."""
    groups = [
        {"params": {"embedding"}, "intermediates": ["add"], "grads": [("g_add",)]},
        {"params": {"head"}, "intermediates": ["matmul"], "grads": [("g_matmul",)]},
        {"params": {"embedding", "query"}, "intermediates": ["add", "scores"], "grads": [("g_add",), ("g_scores",)]},
    ]
    merged = _disjoint(groups)
    assert sorted(sorted(g["params"]) for g in merged) == [["embedding", "query"], ["head"]]
    together = next(g for g in merged if "query" in g["params"])
    assert dict(zip(together["intermediates"], together["grads"])) == {"add": ("g_add",), "scores": ("g_scores",)}
