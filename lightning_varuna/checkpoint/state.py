"""Model and optimizer state keyed by parameter name, so that it does not depend on how the model was cut.

torch's optimizer ``state_dict`` numbers parameters by their position in one optimizer; a stage's optimizer
holds a different subset for every pipeline shape. Keyed by the parameter's name instead, the state of each
parameter loads into whichever stage holds it next time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.optim import Optimizer

from lightning_varuna.partition.released import stage_state_dicts

__all__ = [
    "OPTIMIZER_PARAMETER_NAMES",
    "TensorsByName",
    "destination_for",
    "empty_like_entry",
    "load_optimizer_state_by_name",
    "optimizer_state_by_name",
    "optimizer_state_by_position",
    "parameter_group_names",
    "parameter_names",
    "set_optimizer_state",
    "stage_tensors",
    "with_versions",
]

OPTIMIZER_PARAMETER_NAMES = "optimizer_parameter_names"
"""The key under which a checkpoint's training state keeps the names of each optimizer's parameters, group by group
in the whole model's order (`parameter_group_names`): the positions torch's ``optimizer.state_dict()`` numbers."""


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for the parameters of ``module`` (a tied parameter gets its first name)."""
    return {id(p): name for name, p in module.named_parameters()}


def optimizer_state_by_name(
    optimizer: Optimizer, module: nn.Module, params: list[nn.Parameter] | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{"state": {name: {...}}, "param_groups": {name: {hyper-parameters}}}`` for the parameters of ``optimizer``
    (those of them in ``params``, if given)."""
    names = parameter_names(module)
    only = None if params is None else {id(p) for p in params}
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        for p in group["params"]:
            if only is not None and id(p) not in only:
                continue
            name = _name_of(p, names, module)
            groups[name] = settings
            if optimizer.state.get(p):
                state[name] = dict(optimizer.state[p])
    return {"state": state, "param_groups": groups}


def _name_of(param: nn.Parameter, names: dict[int, str], module: nn.Module) -> str:
    if id(param) not in names:
        raise ValueError(
            f"The optimizer holds a parameter of shape {tuple(param.shape)} that is not a parameter of "
            f"`{type(module).__name__}`: the strategies place, spill and checkpoint the module's parameters, and "
            "keep optimizer state by their names. Register it on the module (an `nn.Parameter` attribute or in an "
            "`nn.ParameterList`)."
        )
    return names[id(param)]


def parameter_group_names(optimizers: list[Optimizer], module: nn.Module) -> list[list[list[str]]]:
    """The names of each optimizer's parameters, group by group, in their order there."""
    names = parameter_names(module)
    return [
        [[_name_of(p, names, module) for p in group["params"]] for group in optimizer.param_groups]
        for optimizer in optimizers
    ]


def optimizer_state_by_position(by_name: dict[str, dict], group_names: list[list[str]]) -> dict[str, Any] | None:
    """What `optimizer_state_by_name` saved, as torch's ``optimizer.state_dict()`` of an optimizer whose groups hold
    the parameters ``group_names`` (None if a group's hyper-parameters were saved with none of its parameters: an
    empty group, or one of parameters that no stage kept)."""
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    position = 0
    for names in group_names:
        settings = next((by_name["param_groups"][name] for name in names if name in by_name["param_groups"]), None)
        if settings is None:
            return None
        groups.append({**settings, "params": list(range(position, position + len(names)))})
        for name in names:
            if name in by_name["state"]:
                state[position] = by_name["state"][name]
            position += 1
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: Optimizer, module: nn.Module, by_name: dict[str, dict]) -> None:
    """Load what `optimizer_state_by_name` saved (by any pipeline shape) into this stage's ``optimizer``."""
    names = parameter_names(module)
    current = optimizer.state_dict()
    state: dict[int, Any] = {}
    groups = []
    for group, saved_group in zip(optimizer.param_groups, current["param_groups"]):
        group_names = [names[id(p)] for p in group["params"]]
        settings = by_name["param_groups"].get(group_names[0], {}) if group_names else {}
        groups.append({**saved_group, **settings, "params": saved_group["params"]})
        for index, name in zip(saved_group["params"], group_names):
            if name in by_name["state"]:
                state[index] = by_name["state"][name]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def set_optimizer_state(optimizer: Optimizer, params: dict[str, nn.Parameter], by_name: dict[str, dict]) -> None:
    """Load what `optimizer_state_by_name` saved for ``params`` (by name) into ``optimizer``, leaving the state of its
    other parameters as it is; a group whose first parameter is among them gets its saved hyper-parameters."""
    for name, p in params.items():
        saved = by_name["state"].get(name)
        if saved:
            optimizer.state[p] = {key: _as_state_of(p, key, value) for key, value in saved.items()}
    for group in optimizer.param_groups:
        first = next((name for name, p in params.items() if group["params"] and p is group["params"][0]), None)
        if first is not None:
            group.update({k: v for k, v in by_name["param_groups"].get(first, {}).items() if k != "params"})


def _as_state_of(param: nn.Parameter, key: str, value: Any) -> Any:
    """A saved optimizer state value on ``param``'s device and, if floating point, in its dtype (as
    ``Optimizer.load_state_dict`` casts it; the step count stays as saved)."""
    if key == "step" or not isinstance(value, torch.Tensor):
        return value
    floating = param.is_floating_point() and value.is_floating_point()
    return value.to(device=param.device, dtype=param.dtype if floating else value.dtype)


class TensorsByName:
    """A Lightning checkpoint dict in memory, read like `SavedTensors`: the model's tensors and each optimizer's
    state by parameter name (a torch ``optimizer.state_dict()`` numbers them by position in ``optimizers``; a file
    that `consolidate` wrote keeps them by name already)."""

    def __init__(self, checkpoint: dict[str, Any], module: nn.Module, optimizers: list[Optimizer]) -> None:
        self._model: dict[str, torch.Tensor] = checkpoint["state_dict"]
        self._optimizers: list[dict[str, Any]] = list(checkpoint.get("optimizer_states_by_name", []))
        if self._optimizers:
            return
        names = parameter_names(module)
        for optimizer, saved in zip(optimizers, checkpoint.get("optimizer_states", [])):
            order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
            self._optimizers.append(
                {
                    "state": {order[i]: value for i, value in saved["state"].items()},
                    "param_groups": {
                        order[i]: {k: v for k, v in group.items() if k != "params"}
                        for group in saved["param_groups"]
                        for i in group["params"]
                    },
                }
            )

    @property
    def has_optimizer_state(self) -> bool:
        return bool(self._optimizers)

    def model(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [name for name in names if name not in self._model]
        if missing:
            raise KeyError(f"The checkpoint has no values for {len(missing)} tensors of this model: {missing[:3]}...")
        return {name: self._model[name] for name in names}

    def optimizer(self, index: int, names: list[str]) -> dict[str, dict[str, Any]]:
        saved = self._optimizers[index]
        wanted = set(names)
        return {part: {k: v for k, v in saved[part].items() if k in wanted} for part in ("state", "param_groups")}


def stage_tensors(saved: Any, module: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any]:
    """The ``state_dict`` (the entries of ``module.state_dict()``) and, if ``saved`` holds optimizer state,
    ``optimizer_states`` (each of ``optimizers``' by parameter name) that Lightning loads into a stage, read from
    ``saved`` (`SavedTensors` or `TensorsByName`)."""
    with stage_state_dicts():
        own = module.state_dict()
    tensors: dict[str, Any] = {"state_dict": with_versions(saved.model(list(own)), own)}
    if optimizers and saved.has_optimizer_state:
        names = parameter_names(module)
        tensors["optimizer_states"] = [
            saved.optimizer(i, [names[id(p)] for group in optimizer.param_groups for p in group["params"]])
            for i, optimizer in enumerate(optimizers)
        ]
    return tensors


def with_versions(state_dict: dict[str, torch.Tensor], like: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``state_dict`` with the module versions of ``like`` (a ``module.state_dict()``) for ``load_state_dict``.

    Without them BatchNorm takes the dict for one of torch before 0.4 and asks for a ``num_batches_tracked`` of every
    BatchNorm, even those of other stages, which a stage's module lacks.
    """
    versioned = OrderedDict(state_dict)
    versioned._metadata = getattr(like, "_metadata", OrderedDict())  # type: ignore[attr-defined]
    return versioned


def destination_for(metadata: Metadata, prefix: str, names: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Empty containers for the checkpoint entries ``prefix.<name>`` or ``prefix.<name>.<field>`` of ``names``.

    Returns the nested dict that ``torch.distributed.checkpoint.load`` fills (tensors allocated from the saved
    sizes and dtypes) and the names that the checkpoint does not have.
    """
    wanted = set(names)
    found: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(prefix + "."):
            continue
        rest = key[len(prefix) + 1 :]
        if rest in wanted:
            found[rest] = empty_like_entry(entry)
            continue
        name, _, field = rest.rpartition(".")
        if name in wanted:
            found.setdefault(name, {})[field] = empty_like_entry(entry)
    return found, [name for name in names if name not in found]


def empty_like_entry(entry: Any) -> Any:
    """An empty tensor of a saved tensor's size and dtype (``None`` for a pickled value: DCP replaces it)."""
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(entry.size, dtype=entry.properties.dtype)
    return None
