"""A spilled model's checkpoint tensors, a shard at a time: what SpillingStrategy writes and reads, keyed by
parameter name as VarunaStrategy keys them (``model.<name>``, ``optimizer.0.state.<name>.<field>``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_varuna.checkpoint.state import optimizer_state_by_name, parameter_names, set_optimizer_state

__all__ = ["SavedByName", "Visit", "checkpoint_pieces", "load_model", "load_optimizer"]

# ``visit(parts, write)``: the model's parameters a shard at a time (`ShardedModel.visit`).
Visit = Callable[[tuple[str, ...], tuple[str, ...]], Iterator[list[nn.Parameter]]]


class SavedByName(Protocol):
    """A checkpoint read by parameter name (`SavedTensors`, `TensorsByName`)."""

    def model(self, names: list[str]) -> dict[str, Tensor]: ...

    def optimizer(self, index: int, names: list[str]) -> dict[str, dict[str, Any]]: ...


def checkpoint_pieces(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, visit: Visit
) -> Iterator[dict[str, Any]]:
    """The tensors of a checkpoint, a shard at a time (with ``optimizer``: its state too); the buffers with the
    first."""
    names = _state_dict_names(module)
    buffers = {name: b for b in names if not isinstance(b, nn.Parameter) for name in names[b]}
    for i, params in enumerate(visit(("state",) if optimizer is not None else (), ())):
        piece: dict[str, Any] = {"model": {name: p.data for p in params for name in names.get(p, [])}}
        if optimizer is not None:
            piece["optimizer"] = {"0": optimizer_state_by_name(optimizer, module, params)}
        if i == 0:
            piece["model"].update(buffers)
        yield piece


def load_model(module: nn.Module, saved: SavedByName, visit: Visit) -> None:
    """Copy the saved parameters and buffers into ``module``, a shard at a time."""
    names = _state_dict_names(module)
    for params in visit((), ("params",)):
        named = {names[p][0]: p for p in params if p in names}
        for name, value in saved.model(list(named)).items():
            named[name].data.copy_(value)
    buffers = {names[b][0]: b for b in names if not isinstance(b, nn.Parameter)}
    for name, value in saved.model(list(buffers)).items():
        buffers[name].copy_(value)


def load_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, saved: SavedByName, visit: Visit) -> None:
    """Load the saved state of optimizer 0 into ``optimizer``, a shard at a time: of the parameters it steps (not
    frozen ones left out of it, which have none)."""
    names = parameter_names(module)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for params in visit(("state",), ("state",)):
        named = {names[id(p)]: p for p in params if id(p) in stepped}
        set_optimizer_state(optimizer, named, saved.optimizer(0, list(named)))


def _state_dict_names(module: nn.Module) -> dict[Tensor, list[str]]:
    """The parameters and persistent buffers of ``module``'s state dict, each with its names there (a tied weight
    has several)."""
    names: dict[Tensor, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(tensor, []).append(name)
    return names
