"""The torch optimizer behind what Lightning hands a strategy."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

__all__ = ["optimized_parameters", "torch_optimizer"]


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """``optimizer`` itself, or the torch optimizer a `LightningOptimizer` wraps."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimized_parameters(optimizer: Any) -> list[torch.nn.Parameter]:
    """The parameters ``optimizer`` (or the torch optimizer a `LightningOptimizer` wraps) steps, group by group."""
    return [p for group in torch_optimizer(optimizer).param_groups for p in group["params"]]
