"""Make ``self.log`` in a pipelined step report what single-device training reports.

Only the last stage sees the loss, and ``training_step`` runs once per micro-batch there. The values a
step logs are recorded per micro-batch and combined as the value's ``reduce_fx`` combines steps: a mean (the
default) with the micro-batch sizes as weights (the loss becomes the mean over the whole batch), a sum (a count of
rows), a max or a min. They are sent to every stage of the replica and logged there once, so that rank 0 (a first
stage) and its loggers see them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["LogRecorder", "replay"]


@dataclass
class _Entry:
    kwargs: dict[str, Any]
    values: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def batch_value(self) -> float:
        """The micro-batches' values combined as ``reduce_fx`` combines steps."""
        reduce_fx = self.kwargs.get("reduce_fx", "mean")
        values = torch.tensor(self.values, dtype=torch.float64)
        if reduce_fx in ("mean", "avg", torch.mean):
            return float((values * torch.tensor(self.weights, dtype=torch.float64)).sum() / sum(self.weights))
        reduce = {"sum": torch.sum, "max": torch.max, "min": torch.min}.get(reduce_fx, reduce_fx)
        return float(reduce(values))


@dataclass
class LogRecorder:
    """Collects ``self.log`` calls of the micro-batch steps of one batch."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    weight: float = 1.0

    @contextmanager
    def capture(self, module: pl.LightningModule) -> Iterator[None]:
        """Route ``module.log`` into this recorder while the micro-batch steps run."""

        def log(name: str, value: Any, **kwargs: Any) -> None:
            self.record(name, value, kwargs)

        module.log = log  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            del module.log

    def record(self, name: str, value: Any, kwargs: dict[str, Any]) -> None:
        if isinstance(value, Metric):
            value = value._forward_cache if value._forward_cache is not None else value.compute()
        if isinstance(value, Tensor):
            value = value.detach().float().item()
        entry = self.entries.setdefault(name, _Entry(kwargs))
        entry.values.append(float(value))
        entry.weights.append(self.weight)

    def summary(self) -> list[tuple[str, float, dict[str, Any]]]:
        """``(name, batch value, log kwargs)`` for every logged name, in the order first logged."""
        return [(name, entry.batch_value(), entry.kwargs) for name, entry in self.entries.items()]


def replay(module: pl.LightningModule, summary: list[tuple[str, float, dict[str, Any]]], device: torch.device) -> None:
    """Log the batch values of ``summary`` through the real ``LightningModule.log``."""
    for name, value, kwargs in summary:
        module.log(name, torch.tensor(value, device=device), **kwargs)
