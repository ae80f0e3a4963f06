"""Make ``self.log`` in a pipelined step report what single-device training reports.

Only the last stage sees the loss, and ``training_step`` runs once per micro-batch there. The values a
step logs are recorded per micro-batch and combined as the value's ``reduce_fx`` combines steps: a mean (the
default) with the micro-batch sizes as weights (the loss becomes the mean over the whole batch), a sum (a count of
rows), a max or a min. They are sent to every stage of the replica and logged there once, so that every rank's
checkpoint monitors and callbacks see them (rank 0, whose loggers write them, holds a last stage).

A torchmetrics metric object is logged as the metric itself on every stage: its state, updated on the last stage
only, is gathered from all ranks when Lightning computes it at the epoch's end (torchmetrics syncs a metric over the
process group), which gives the epoch's value exactly, also for metrics that are not means over rows (F1, AUROC).
The other stages' metrics hold no rows but are given empty states of the last stage's types, which torchmetrics
needs to gather states of several types (AUROC's float scores and integer targets). Its value per step is computed
from what its states gained in the step, which is the whole batch's value (for states that are sums or lists of
rows: F1, AUROC, accuracy, a mean); a metric with other states (a running max) is reported by its micro-batch
values combined as a logged number's.
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
from torchmetrics.utilities.data import dim_zero_sum

__all__ = ["STAGE_REPLICAS", "LogRecorder", "MetricAt", "replay"]

# The ``sync_dist_group`` of a replayed value: the strategy reduces it over the replicas of the rank's stage. A name
# rather than the process group, which is made again at every set-up: Lightning requires a value logged again (in
# the next fit of the same Trainer) to name the same group.
STAGE_REPLICAS = "the replicas of this rank's pipeline stage"


@dataclass
class _Entry:
    kwargs: dict[str, Any]
    values: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # each micro-batch's, where the step passes ``batch_size``
    returned_by: Metric | None = None  # the metric whose forward returned the values (``self.acc(preds, y)``)

    def batch_kwargs(self) -> dict[str, Any]:
        """The ``self.log`` arguments of the batch: a ``batch_size`` the step passed is its micro-batches' sum (what
        Lightning weights the batch's value by in the epoch's mean)."""
        return {**self.kwargs, "batch_size": sum(self.batch_sizes)} if self.batch_sizes else self.kwargs

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
    """A logged torchmetrics metric, by its name among the module's submodules; ``step_value``: its value for the
    step (None: not logged per step); ``list_states``: the dtype and row shape of each of its list states."""

    path: str
    step_value: float | None = None
    list_states: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)


@dataclass
class LogRecorder:
    """Collects ``self.log`` calls of the micro-batch steps of one batch; ``training``: of ``training_step``, whose
    values Lightning logs per step by default (other steps' per epoch)."""

    training: bool = True
    entries: dict[str, _Entry] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # the name logged -> the metric's path in the module
    weight: float = 1.0
    _module: pl.LightningModule | None = None
    _states_before: dict[int, dict[str, Tensor | int]] = field(default_factory=dict)  # id(metric) -> its states
    _metrics: list[Metric] = field(default_factory=list)  # the module's

    @contextmanager
    def capture(self, module: pl.LightningModule) -> Iterator[None]:
        """Route ``module.log`` into this recorder while the micro-batch steps run."""

        def log(name: str, value: Any, **kwargs: Any) -> None:
            self.record(name, value, kwargs)

        module.log = log  # type: ignore[method-assign,assignment]
        self._module = module
        self._metrics = [m for m in module.modules() if isinstance(m, Metric)]
        self._states_before = {id(m): _states_of(m) for m in self._metrics}
        try:
            yield
        finally:
            del module.log

    def record(self, name: str, value: Any, kwargs: dict[str, Any]) -> None:
        if isinstance(value, Metric):
            path = self.metrics.get(name) or self._path_of(value)  # once a step: a walk over every module
            if path is not None:
                self.metrics[name] = path
                if not self._per_step(kwargs):
                    self.entries.setdefault(name, _Entry(kwargs))
                    return
            value = value._forward_cache if value._forward_cache is not None else value.compute()
        returned_by = next((m for m in self._metrics if m._forward_cache is value), None)
        if isinstance(value, Tensor):
            value = value.detach().item()
        entry = self.entries.setdefault(name, _Entry(kwargs, returned_by=returned_by))
        entry.values.append(float(value))
        entry.weights.append(self.weight)
        if kwargs.get("batch_size") is not None:
            entry.batch_sizes.append(kwargs["batch_size"])

    def _path_of(self, metric: Metric) -> str | None:
        modules = self._module.named_modules() if self._module is not None else ()
        return next((path for path, module in modules if module is metric), None)

    def _per_step(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("on_step", self.training)

    def summary(self) -> list[tuple[str, float | MetricAt, dict[str, Any]]]:
        """``(name, batch value or metric, log kwargs)`` for every logged name, in the order first logged."""
        return [
            (name, self._metric_at(name, entry) if name in self.metrics else self._batch_value(entry), kwargs)
            for name, entry in self.entries.items()
            for kwargs in [entry.batch_kwargs()]
        ]

    def _batch_value(self, entry: _Entry) -> float:
        """A number's value for the batch; of a metric's forward, the metric over the rows the batch added to its
        states (a macro accuracy is not a mean over micro-batches), where that can be told."""
        metric = entry.returned_by
        before = self._states_before.get(id(metric)) if metric is not None else None
        value = _value_over_what_was_added(metric, before) if metric is not None and before is not None else None
        return entry.batch_value() if value is None else value

    def _metric_at(self, name: str, entry: _Entry) -> MetricAt:
        assert self._module is not None
        path = self.metrics[name]
        metric = self._module.get_submodule(path)
        assert isinstance(metric, Metric)
        lists = {
            state: (value[0].dtype, tuple(value[0].shape[1:]))
            for state, value in metric.metric_state.items()
            if isinstance(value, list) and value and isinstance(value[0], Tensor)
        }
        step_value = None
        if entry.values:
            before = self._states_before.get(id(metric))
            step_value = _value_over_what_was_added(metric, before) if before is not None else None
            step_value = entry.batch_value() if step_value is None else step_value
        return MetricAt(path, step_value, lists)


def replay(
    module: pl.LightningModule, summary: list[tuple[str, float | MetricAt, dict[str, Any]]], device: torch.device
) -> None:
    """Log the batch values and metrics of ``summary`` through the real ``LightningModule.log``; a ``sync_dist``
    value that names no group is reduced over `STAGE_REPLICAS` (every stage logs its replica's value: over all
    ranks, a sum would count each replica once per stage)."""
    for name, value, kwargs in summary:
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            kwargs = {**kwargs, "sync_dist_group": STAGE_REPLICAS}
        if isinstance(value, MetricAt):
            metric = module.get_submodule(value.path)
            assert isinstance(metric, Metric)
            _hold_no_rows_of_the_same_types(metric, value.list_states, device)
            if value.step_value is not None:
                # What Lightning logs for the step: the batch's value on every stage (``sync_dist``: the mean over
                # the replicas', as for a number; the global batch's for a mean over rows).
                step_value = torch.tensor(value.step_value, device=device)
                if kwargs.get("sync_dist"):
                    step_value = module.trainer.strategy.reduce(step_value, kwargs.get("sync_dist_group"), "mean")
                metric._forward_cache = step_value  # type: ignore[assignment]
            module.log(name, metric, **kwargs)
        else:
            module.log(name, torch.tensor(value, device=device), **kwargs)


def _states_of(metric: Metric) -> dict[str, Tensor | int]:
    """What a metric holds now: its tensor states (copied) and the lengths of its list states."""
    return {name: len(v) if isinstance(v, list) else v.clone() for name, v in metric.metric_state.items()}


def _value_over_what_was_added(metric: Metric, before: dict[str, Tensor | int]) -> float | None:
    """The metric computed (on this rank) over the rows added to its states since they were ``before``; None where
    that cannot be told apart (a state that is not a sum or a list of rows) or the value is not one number."""
    added: dict[str, Any] = {}
    for name, value in metric.metric_state.items():
        if isinstance(value, list):
            added[name] = value[before[name] :]
        elif metric._reductions[name] is dim_zero_sum:
            added[name] = value - before[name]
        else:
            return None
    if not added:
        return None
    kept = {name: getattr(metric, name) for name in added}
    try:
        for name, value in added.items():
            setattr(metric, name, value)
        result = type(metric).compute(metric)  # the class's own compute: neither synced nor cached
    finally:
        for name, value in kept.items():
            setattr(metric, name, value)
    return float(result) if isinstance(result, Tensor) and result.numel() == 1 else None


def _hold_no_rows_of_the_same_types(
    metric: Metric, list_states: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device
) -> None:
    """Give a metric that was never updated here an empty tensor of the last stage's type in each list state (in
    place of the float32 that torchmetrics would gather for it), and count it as updated (it holds no rows, rightly:
    no "compute before update" warning). Its value computed before is dropped, as the last stage's update dropped
    it there: computed again, it syncs with the last stage (a value computed at the end of one validation loader
    and logged again from the next would otherwise sync on the last stage alone, and the job would hang)."""
    for state, (dtype, row_shape) in list_states.items():
        value = getattr(metric, state)
        if not value:
            value.append(torch.empty((0, *row_shape), dtype=dtype, device=device))
    metric._update_count = max(metric._update_count, 1)
    metric._computed = None
