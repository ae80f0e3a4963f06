"""A LightningModule's steps (``training_step``, ``validation_step``, ...) on this rank's pipeline stage, a batch at a
time: what a strategy's step hooks run."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_varuna.data.microbatch import batch_size_of, microbatch_sizes
from lightning_varuna.pipeline.schedules import make_schedule
from lightning_varuna.pipeline.stage import Stage
from lightning_varuna.pipeline.step import MicroBatchedStep
from lightning_varuna.pipeline.step_logging import replay
from lightning_varuna.pipeline.step_results import StepResults
from lightning_varuna.pipeline.topology import PipelineGroups, Topology

__all__ = ["Failures", "StageSteps"]


class Failures(Protocol):
    """How a step learns that the job ended, and leaves its own error for the other ranks (`RunFailures`)."""

    def stop_if_job_ended(self) -> None:
        """Raise if the job ended (a peer failed, SIGTERM): called while the stage waits for a peer."""

    def reported(self) -> AbstractContextManager[None]:
        """The block in which this rank's error is left for the other ranks."""


class StageSteps:
    """Runs a step of every micro-batch of a batch through the pipeline under a schedule (`MicroBatchedStep`); what
    the step logged and returned on the last stage is sent to the replica's other stages (`results`), and logged and
    returned there too.

    Args:
        module: the LightningModule.
        stage: this rank's stage of it.
        topology: this rank's place in the job.
        groups: the job's process groups.
        device: where the step's outputs are returned.
        loss_items: `VarunaStrategy`'s ``loss_items``.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        stage: Stage,
        topology: Topology,
        groups: PipelineGroups,
        device: torch.device,
        loss_items: Callable[[Any], int | Tensor] | None = None,
    ) -> None:
        self._module, self._stage, self._topology, self._groups, self._device = module, stage, topology, groups, device
        self._loss_items = loss_items
        self.results = StepResults(topology, groups.results, stage.runtime.waiter)

    def run(
        self,
        step_name: str,
        args: tuple,
        kwargs: dict,
        micro_batch_size: int,
        schedule: str | None,
        scaler: torch.amp.GradScaler | None,
        failures: Failures,
    ) -> Any:
        """``module.<step_name>(*args, **kwargs)`` over the micro-batches of ``micro_batch_size`` rows of the batch
        ``args[0]``; its output on the last stage, on every stage.

        Args:
            schedule: the name of the schedule of a training step (a forward and a backward of each micro-batch);
                None: a forward of each (validation, test, predict).
            scaler: the grad scaler that scales a training step's loss (fp16), or None.
            failures: what the step gives up on, and where it leaves its error.
        """
        module, topo, batch, loss_items = self._module, self._topology, args[0], self._loss_items
        training = schedule is not None
        num_microbatches = len(microbatch_sizes(batch_size_of(batch), micro_batch_size))
        actions = make_schedule(
            schedule, topo.pipeline_parallel_size, num_microbatches, topo.stages_per_rank, topo.v_shape
        )
        share = self._share_of_items(batch) / module.trainer.accumulate_grad_batches if training else 1.0
        step = MicroBatchedStep(
            module,
            self._stage,
            step_name,
            args[1:],
            kwargs,
            loss_weight=share,
            scale_loss=scaler.scale if scaler is not None else None,
            loss_items=loss_items,
        )
        on_wait = failures.stop_if_job_ended
        with failures.reported():
            outputs = step.run(batch, micro_batch_size, actions[topo.pp_rank], training=training, on_wait=on_wait)
            results = (step.recorder.summary(), outputs, module.trainer.should_stop)
            summary, outputs, stop = self.results.exchange(results, on_wait)
        module.trainer.should_stop |= stop  # set by the step itself, which ran on the last stage
        replay(module, summary, self._device)
        return tree_map(lambda t: t.to(self._device) if isinstance(t, Tensor) else t, outputs)

    def _share_of_items(self, batch: Any) -> float:
        """This replica's share of the items (``loss_items``) of every replica's batch, on the last stage (where
        losses are weighted): 1 / replicas for rows, which every replica has as many of."""
        topo, loss_items = self._topology, self._loss_items
        if loss_items is None or topo.data_parallel_size == 1 or not topo.is_last_stage:
            return 1 / topo.data_parallel_size
        items = torch.as_tensor(loss_items(batch), dtype=torch.float64, device=self._device)
        every_replica = items.clone()
        dist.all_reduce(every_replica, group=self._groups.replicas)
        return float(items / every_replica)
