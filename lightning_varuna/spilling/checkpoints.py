"""A spilled model's checkpoints, a shard at a time: what SpillingStrategy writes and reads, in VarunaStrategy's
sharded format (a folder at any fsspec URL) and keyed by parameter name as VarunaStrategy keys them
(``model.<name>``, ``optimizer.0.state.<name>.<field>``); a plain Lightning checkpoint file is read too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_varuna.checkpoint.consolidate import RUN_SHAPE
from lightning_varuna.checkpoint.sharded import SavedTensors, ShardedCheckpoints
from lightning_varuna.checkpoint.state import (
    OPTIMIZER_PARAMETER_NAMES,
    TensorsByName,
    optimizer_state_by_name,
    parameter_group_names,
    parameter_names,
    set_optimizer_state,
)
from lightning_varuna.storage import Storage

__all__ = ["SavedByName", "SpilledCheckpoints", "Visit", "checkpoint_pieces", "load_model", "load_optimizer"]

# ``visit(parts, write)``: the model's parameters a shard at a time (`ShardedModel.visit`).
Visit = Callable[[tuple[str, ...], tuple[str, ...]], Iterator[list[nn.Parameter]]]


class SavedByName(Protocol):
    """A checkpoint read by parameter name (`SavedTensors`, `TensorsByName`)."""

    def model(self, names: list[str]) -> dict[str, Tensor]: ...

    def optimizer(self, index: int, names: list[str]) -> dict[str, dict[str, Any]]: ...


class SpilledCheckpoints:
    """Save and load a spilled model's checkpoints a shard at a time (the model is never gathered).

    A load reads Lightning's training state first (`load`), then the tensors into the model (`load_model`) and
    into its optimizer (`load_optimizer`), a shard at a time, as Lightning restores a checkpoint.

    Args:
        storage: how to reach the checkpoints' URLs.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.sharded = ShardedCheckpoints(storage)
        self._loading: SavedTensors | TensorsByName | None = None  # the checkpoint being restored

    def save(
        self,
        checkpoint: dict[str, Any],
        url: str,
        shape: dict[str, Any],
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        visit: Visit,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """Write Lightning's ``checkpoint`` to the folder ``url``, its tensors a shard at a time; the ``optimizer``'s
        state too if Lightning saves optimizer states. ``shape``: the run's (`run_shape`)."""
        lightning_state = dict(checkpoint)
        lightning_state.pop("state_dict", None)
        if lightning_state.pop("optimizer_states", None) is None:
            optimizer = None
        if optimizer is not None:
            lightning_state[OPTIMIZER_PARAMETER_NAMES] = parameter_group_names([optimizer], module)
        pieces = checkpoint_pieces(module, optimizer, visit)
        self.sharded.save_pieces(pieces, lightning_state, url, shape, storage_options)

    def load(
        self,
        url: str,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        load_file: Callable[[], dict[str, Any]],
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Lightning's training state of the checkpoint at ``url`` (of SpillingStrategy or VarunaStrategy, any
        shape; or a Lightning checkpoint file, which ``load_file()`` reads), with its tensors left out for
        `load_model` and `load_optimizer`; and the shape of the run that saved it (empty if it did not say)."""
        fs, path = self.storage.fs(url)
        if fs.isfile(path):
            checkpoint = load_file()
            shape = checkpoint.get(RUN_SHAPE) or {}
            self._loading = TensorsByName(checkpoint, module, optimizers)
        else:
            saved = SavedTensors(self.storage, url)
            checkpoint, shape = saved.training_state(), saved.info.shape
            self._loading = saved
        checkpoint["state_dict"] = {}
        if self._loading.has_optimizer_state:
            checkpoint["optimizer_states"] = [{} for _ in optimizers]
        return checkpoint, shape

    def load_model(self, module: nn.Module, visit: Visit) -> None:
        """Copy the loaded checkpoint's parameters and buffers into ``module``, a shard at a time."""
        load_model(module, self._saved(), visit)

    def load_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer, visit: Visit) -> None:
        """Load the loaded checkpoint's optimizer state into ``optimizer``, a shard at a time; the load is done."""
        load_optimizer(module, optimizer, self._saved(), visit)
        self._loading = None

    def _saved(self) -> SavedTensors | TensorsByName:
        if self._loading is None:
            raise RuntimeError("SpillingStrategy reads a checkpoint's tensors after `load_checkpoint`.")
        return self._loading


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
