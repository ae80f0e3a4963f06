"""Make ``self.log`` in a pipelined step report what single-device training reports.

Only the last stage sees the loss, and ``training_step`` runs once per micro-batch there. The values a
step logs are recorded per micro-batch, averaged with the micro-batch sizes as weights (the loss becomes
the mean over the whole batch), sent to every stage of the replica and logged there once, so that rank 0
(a first stage) and its loggers see them too.
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
    weighted_sum: float = 0.0
    weight: float = 0.0


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
        entry.weighted_sum += self.weight * float(value)
        entry.weight += self.weight

    def summary(self) -> list[tuple[str, float, dict[str, Any]]]:
        """``(name, batch value, log kwargs)`` for every logged name, in the order first logged."""
        return [(name, e.weighted_sum / e.weight, e.kwargs) for name, e in self.entries.items()]


def replay(module: pl.LightningModule, summary: list[tuple[str, float, dict[str, Any]]], device: torch.device) -> None:
    """Log the batch values of ``summary`` through the real ``LightningModule.log``."""
    for name, value, kwargs in summary:
        module.log(name, torch.tensor(value, device=device), **kwargs)
