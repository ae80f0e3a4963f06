"""The torch optimizer behind what Lightning hands a strategy."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

__all__ = ["torch_optimizer"]


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """``optimizer`` itself, or the torch optimizer a `LightningOptimizer` wraps."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
