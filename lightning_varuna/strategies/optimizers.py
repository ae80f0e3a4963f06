"""The torch optimizer behind what Lightning hands a strategy, the parameters it steps, and the parameter groups of a
pipeline stage's optimizers, made as on one device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_varuna.checkpoint.state import parameter_group_names
from lightning_varuna.partition.skeleton import ModelSkeleton

__all__ = ["StageParameterGroups", "optimized_parameters", "torch_optimizer"]


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """``optimizer`` itself, or the torch optimizer a `LightningOptimizer` wraps."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimized_parameters(optimizer: Any) -> list[torch.nn.Parameter]:
    """The parameters ``optimizer`` (or the torch optimizer a `LightningOptimizer` wraps) steps, group by group."""
    return [p for group in torch_optimizer(optimizer).param_groups for p in group["params"]]


class StageParameterGroups:
    """The parameter groups of a pipeline stage's optimizers, as on one device: made (by ``configure_optimizers``, or
    added by a finetuning callback) while memory-free stand-ins take the other stages' parameters' places, each group
    then keeps this stage's parameters, maybe none. Every stage has the groups of one device (for schedulers and
    callbacks that index them), and a stage whose parameters are all frozen gets an optimizer over none rather than
    an error."""

    def __init__(self) -> None:
        self.names: list[list[list[str]]] = []  # the whole model's parameters, by optimizer and group, as made

    @contextmanager
    def whole_model(
        self, module: torch.nn.Module, skeleton: ModelSkeleton, optimizers: Callable[[], list]
    ) -> Iterator[None]:
        """Inside, the other stages' parameters of ``module`` have stand-ins; after, the ``optimizers()``' groups hold
        none of them, and `names` the whole model's."""
        with skeleton.stand_ins(module, missing_only=True):
            yield
            self.names = parameter_group_names([torch_optimizer(o) for o in optimizers()], module)
        _keep_own_parameters(optimizers(), module)


def _keep_own_parameters(optimizers: list[Any], module: torch.nn.Module) -> None:
    """Leave in each parameter group of ``optimizers`` only the parameters ``module`` holds (a pipeline stage's)."""
    own = {id(p) for p in module.parameters()}
    for optimizer in optimizers:
        for group in torch_optimizer(optimizer).param_groups:
            group["params"] = [p for p in group["params"] if id(p) in own]
