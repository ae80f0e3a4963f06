"""Run the LightningModule's own hooks that read what only some stages hold, and log what they log on every stage.

- **Epoch-end hooks** (``on_train_epoch_end``, ``on_validation_epoch_end``, ...) run on the last stage only. Only
  the last stage runs the code of a step that comes after ``self(...)``, so what the steps keep for the epoch's end
  (outputs appended to a list, a metric they update) is the last stage's alone: on the other stages the list is
  empty. The values the hooks log are sent to the replica's other stages and logged there too, as a step's are
  (`step_logging`), so that every rank's checkpoint monitors and a ``sync_dist`` reduction see them. Rank 0 holds
  the last stage of replica 0 (`Topology`), so rank-zero code in the hooks (loggers, ``@rank_zero_only``) runs.
  What the hooks gather themselves (``self.all_gather``, a torchmetrics metric's ``compute()``) is gathered over
  the last stages of the replicas (``inside``), which hold all of it. What they set in the optimizers (a learning
  rate changed by hand) and the learning-rate schedulers (one stepped by hand) is set on the other stages too
  (`optimizer_settings`); their other effects stay the last stage's.
- **on_before_optimizer_step** runs on every stage, each seeing its own parameters' gradients. The values it logs
  on the stages are merged and logged on every stage: a name one stage logs is that stage's value, Lightning's
  ``grad_norm`` total (``grad_{p}_norm_total``) is the p-norm of the stages' totals (the norm over all gradients,
  a weight tied across stages counted once), and another name that several stages log is the last stage's value
  (a warning names it where the stages' values differ). A ``sync_dist`` value is reduced over the replicas of the
  stage (`replay`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import Metric

from lightning_varuna.hook_wrapping import restore_hooks, wrap_hook
from lightning_varuna.pipeline.optimizer_settings import OptimizerSettings, load_optimizer_settings, optimizer_settings
from lightning_varuna.pipeline.step_logging import LogRecorder, MetricAt, replay

__all__ = ["EPOCH_END_HOOKS", "PipelinedModuleHooks", "differing_names", "merge_stage_logs", "metrics_synced_over"]

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end", "on_predict_epoch_end")
_GRAD_NORM_TOTAL = re.compile(r"grad_(.+)_norm_total")  # the key of Lightning's `grad_norm` total

Logged = list[tuple[str, float | MetricAt, dict[str, Any]]]  # a `LogRecorder.summary`


class PipelinedModuleHooks:
    """Makes the hooks that ``module`` overrides run as the module docstring says, until `restore`.

    Args:
        module: the LightningModule.
        is_last_stage: whether this rank holds the last stage.
        inside: a context for an epoch-end hook on the last stage (collectives over the last stages).
        exchange: on the last stage, sends what it is given to the other stages and returns it; elsewhere,
            returns what the last stage sent.
        gather: what each stage of the replica gives, in stage order (every stage calls it).
    """

    def __init__(
        self,
        module: pl.LightningModule,
        is_last_stage: bool,
        inside: Callable[[], AbstractContextManager[Any]],
        exchange: Callable[[Any], Any],
        gather: Callable[[Any], list[Any]],
    ) -> None:
        self.module, self.is_last_stage, self.inside = module, is_last_stage, inside
        self.exchange, self.gather = exchange, gather
        self._warned: set[str] = set()  # names `on_before_optimizer_step` logs differently on the stages
        for name in EPOCH_END_HOOKS:
            self._wrap(name, self._on_last_stage)
        self._wrap("on_before_optimizer_step", self._on_every_stage)

    def _wrap(self, name: str, run: Callable[..., None]) -> None:
        if is_overridden(name, self.module):
            wrap_hook(self.module, name, run)

    def _on_last_stage(self, hook: Callable[..., None], *args: Any) -> None:
        logged: Logged | None = None
        settings: OptimizerSettings | TypeError | None = None
        if self.is_last_stage:
            recorder = LogRecorder(training=False)  # an epoch-end hook logs for the epoch by default
            with recorder.capture(self.module), self.inside():
                hook(*args)
            logged = recorder.summary()
            for metric in self.module.modules():
                if isinstance(metric, Metric):
                    # A value the hook computed over the last stages only; computed again (over every rank, as
                    # on the other stages) if Lightning computes the metric at the epoch's end.
                    metric._computed = None
            try:
                settings = optimizer_settings(self.module.trainer)
            except TypeError as error:  # raised on every stage, not only here (the others would wait for it)
                settings = error
        logged, settings = self.exchange((logged, settings))
        if isinstance(settings, TypeError):
            raise settings
        if not self.is_last_stage and settings is not None:
            load_optimizer_settings(self.module.trainer, settings)
        replay(self.module, logged, self.module.device)

    def _on_every_stage(self, hook: Callable[..., None], *args: Any) -> None:
        recorder = LogRecorder()
        with recorder.capture(self.module):
            hook(*args)
        stages = self.gather(recorder.summary())
        differing = differing_names(stages) - self._warned
        if differing:
            self._warned |= differing
            rank_zero_warn(
                f"`on_before_optimizer_step` logged {sorted(differing)} with a different value on each pipeline "
                "stage (each sees its own parameters' gradients); the last stage's is logged. For gradient norms "
                "over the whole model log Lightning's `grad_norm(self, norm_type)` dict, whose total is merged."
            )
        replay(self.module, merge_stage_logs(stages), self.module.device)

    def restore(self) -> None:
        """Give the module its own hooks back."""
        restore_hooks(self.module)


def merge_stage_logs(stages: list[Logged]) -> Logged:
    """The values the stages logged (in stage order) as one stage's: see the module docstring."""
    merged: dict[str, tuple[float | MetricAt, dict[str, Any]]] = {}
    for logged in stages:
        for name, value, kwargs in logged:
            total = _GRAD_NORM_TOTAL.fullmatch(name)
            if name in merged and total is not None and isinstance(value, float):
                before = merged[name][0]
                assert isinstance(before, float)
                value = _norm_of_norms(before, value, float(total.group(1)))
            merged[name] = value, kwargs
    for name, (value, kwargs) in merged.items():
        total = _GRAD_NORM_TOTAL.fullmatch(name)
        if total is not None and isinstance(value, float):
            merged[name] = _counting_shared_once(value, float(total.group(1)), _repeats(stages, name)), kwargs
    return [(name, value, kwargs) for name, (value, kwargs) in merged.items()]


def _repeats(stages: list[Logged], total_name: str) -> list[float]:
    """The norms of a `grad_norm` total's parameters that several stages logged (a weight tied across stages, whose
    summed gradient each holder has), once for each holder after the first."""
    prefix = total_name.removesuffix("_total")
    seen: set[str] = set()
    repeats = []
    for logged in stages:
        for name, value, _ in logged:
            if name.startswith(prefix) and name != total_name and isinstance(value, float):
                if name in seen:
                    repeats.append(value)
                seen.add(name)
    return repeats


def _counting_shared_once(total: float, p: float, repeats: list[float]) -> float:
    """A p-norm of norms less the norms counted more than once."""
    if math.isinf(p) or not repeats:
        return total
    return max(total**p - sum(norm**p for norm in repeats), 0.0) ** (1 / p)


def differing_names(stages: list[Logged]) -> set[str]:
    """Names that several stages logged with different numbers (other than Lightning's `grad_norm` totals)."""
    values: dict[str, set[float]] = {}
    for logged in stages:
        for name, value, _ in logged:
            if isinstance(value, float) and not _GRAD_NORM_TOTAL.fullmatch(name):
                values.setdefault(name, set()).add(value)
    return {name for name, seen in values.items() if len(seen) > 1}


def _norm_of_norms(a: float, b: float, p: float) -> float:
    """The p-norm of two vectors put together, from their p-norms."""
    return max(a, b) if math.isinf(p) else (a**p + b**p) ** (1 / p)


@contextmanager
def metrics_synced_over(module: pl.LightningModule, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Inside, the torchmetrics metrics of ``module`` gather their state over ``group`` when computed."""
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    before = [m.process_group for m in metrics]
    for metric in metrics:
        metric.process_group = group
    try:
        yield
    finally:
        for metric, group_before in zip(metrics, before, strict=True):
            metric.process_group = group_before
