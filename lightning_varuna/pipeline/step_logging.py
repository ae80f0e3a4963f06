"""Make ``self.log`` in a pipelined step report what single-device training reports.

Only the last stage sees the loss, and ``training_step`` runs once per micro-batch there. The values a
step logs are recorded per micro-batch and combined as the value's ``reduce_fx`` combines steps: a mean (the
default) with the micro-batch sizes as weights (the loss becomes the mean over the whole batch), a sum (a count of
rows), a max or a min. They are sent to every stage of the replica and logged there once, so that rank 0 (a first
stage) and its loggers see them too.

A torchmetrics metric logged for the epoch only (``validation_step``'s default) is logged as the metric itself on
every stage: its state, updated on the last stage only, is gathered from all ranks when Lightning computes it at
the epoch's end (torchmetrics syncs a metric over the process group), which gives the epoch's value exactly, also
for metrics that are not means over rows (F1, AUROC).
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

__all__ = ["LogRecorder", "MetricAt", "replay"]


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


@dataclass(frozen=True)
class MetricAt:
    """A logged torchmetrics metric, by its name among the module's submodules."""

    path: str


@dataclass
class LogRecorder:
    """Collects ``self.log`` calls of the micro-batch steps of one batch; ``training``: of ``training_step``, whose
    values Lightning logs per step by default (other steps' per epoch)."""

    training: bool = True
    entries: dict[str, _Entry] = field(default_factory=dict)
    metrics: dict[str, MetricAt] = field(default_factory=dict)
    weight: float = 1.0
    _module: pl.LightningModule | None = None

    @contextmanager
    def capture(self, module: pl.LightningModule) -> Iterator[None]:
        """Route ``module.log`` into this recorder while the micro-batch steps run."""

        def log(name: str, value: Any, **kwargs: Any) -> None:
            self.record(name, value, kwargs)

        module.log = log  # type: ignore[method-assign,assignment]
        self._module = module
        try:
            yield
        finally:
            del module.log

    def record(self, name: str, value: Any, kwargs: dict[str, Any]) -> None:
        if isinstance(value, Metric) and self._for_the_epoch_only(kwargs):
            path = self._path_of(value)
            if path is not None:
                self.metrics[name] = MetricAt(path)
                self.entries.setdefault(name, _Entry(kwargs))
                return
        if isinstance(value, Metric):
            value = value._forward_cache if value._forward_cache is not None else value.compute()
        if isinstance(value, Tensor):
            value = value.detach().float().item()
        entry = self.entries.setdefault(name, _Entry(kwargs))
        entry.values.append(float(value))
        entry.weights.append(self.weight)

    def _path_of(self, metric: Metric) -> str | None:
        modules = self._module.named_modules() if self._module is not None else ()
        return next((path for path, module in modules if module is metric), None)

    def _for_the_epoch_only(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("on_epoch", not self.training) and not kwargs.get("on_step", self.training)

    def summary(self) -> list[tuple[str, float | MetricAt, dict[str, Any]]]:
        """``(name, batch value or metric, log kwargs)`` for every logged name, in the order first logged."""
        return [
            (name, self.metrics[name] if name in self.metrics else entry.batch_value(), entry.kwargs)
            for name, entry in self.entries.items()
        ]


def replay(
    module: pl.LightningModule, summary: list[tuple[str, float | MetricAt, dict[str, Any]]], device: torch.device
) -> None:
    """Log the batch values and metrics of ``summary`` through the real ``LightningModule.log``."""
    for name, value, kwargs in summary:
        if isinstance(value, MetricAt):
            metric = module.get_submodule(value.path)
            assert isinstance(metric, Metric)
            module.log(name, metric, **kwargs)
        else:
            module.log(name, torch.tensor(value, device=device), **kwargs)
