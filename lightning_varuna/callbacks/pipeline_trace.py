"""`PipelineTrace`: the measured timeline of a training step, as a Chrome / Perfetto trace."""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_varuna.data.microbatch import batch_size_of
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.profiling.trace import Span, chrome_trace, work_of
from lightning_varuna.storage import Storage

__all__ = ["PipelineTrace", "RecordsTimeline"]


@runtime_checkable
class RecordsTimeline(Protocol):
    """What `PipelineTrace` needs from the Trainer's strategy (`VarunaStrategy` has it): the pipeline's shape and
    this rank's recorded actions."""

    topology: Topology | None
    micro_batch_size: int
    schedule: str

    def record_timeline(self) -> None:
        """Record when each action of the coming training steps runs on this rank."""

    def take_timeline(self) -> list[tuple[str, float, float]]:
        """Stop recording; return this rank's ``(action, start, end)`` in wall-clock seconds."""


class PipelineTrace(pl.Callback):
    """Record one training step of a `VarunaStrategy` run on every rank and write it as a trace file.

    The trace has a process per data-parallel replica and a thread per pipeline stage (under an interleaved schedule:
    per rank, named with its stages, ``stages 0, 2``, each action with its stage: ``2F3``); each forward,
    recompute and backward shows when it computed (waiting for a message is left out, so the gaps are the
    bubble), followed by the gradient all-reduce and the optimizer step. Open it in https://ui.perfetto.dev
    next to the simulator's prediction (``lightning-varuna autoconfig --trace``), or teach the profile what
    the step costs beyond its segments with ``lightning-varuna calibrate``.

    Args:
        path: where to write the trace (any fsspec URL), written by rank 0.
        step: the global step to record (after a few steps, when the allocator and caches are warm).
        steps: how many steps to record from there, one after another in the trace (``lightning-varuna
            calibrate`` takes the median step, which one disturbed step does not move).
    """

    def __init__(self, path: str, step: int = 5, steps: int = 1, storage_options: dict[str, Any] | None = None) -> None:
        self.path, self.step, self.steps = path, step, steps
        self._storage = Storage(storage_options)
        self._recording = False
        self._optimizer_start: float | None = None
        self.spans: list[Span] = []
        self._recorded = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step >= self.step and self._recorded < self.steps:
            _varuna(trainer).record_timeline()
            self._recording, self._optimizer_start = True, None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._recording:
            self._optimizer_start = time.time()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not self._recording:
            return
        self._recording = False
        strategy = _varuna(trainer)
        topology = strategy.topology
        assert topology is not None
        mine = strategy.take_timeline()
        if self._optimizer_start is not None:  # not on a batch that only accumulates gradients
            mine.append(("optimizer", self._optimizer_start, time.time()))
        ranks: list[Any] = [None] * trainer.world_size
        if dist.is_available() and dist.is_initialized():
            dist.all_gather_object(ranks, (topology.dp_rank, topology.pp_rank, mine))
        else:
            ranks = [(0, 0, mine)]
        step = self.step + self._recorded
        self.spans += [
            Span(stage, work_of(name), start, end, replica, step)
            for replica, stage, spans in ranks
            for name, start, end in spans
        ]
        self._recorded += 1
        if trainer.is_global_zero and self._recorded == self.steps:
            per_rank = f" V={topology.stages_per_rank}" if topology.stages_per_rank > 1 else ""
            title = (
                f"measured step {self.step}{f'-{step}' if step > self.step else ''}: "
                f"P={topology.pipeline_parallel_size} D={topology.data_parallel_size} "
                f"mb={strategy.micro_batch_size} {strategy.schedule}{per_rank}"
            )
            config = {  # what `lightning-varuna calibrate` needs to simulate these steps
                "pipeline_parallel_size": topology.pipeline_parallel_size,
                "data_parallel_size": topology.data_parallel_size,
                "micro_batch_size": strategy.micro_batch_size,
                "schedule": strategy.schedule,
                "global_batch_size": batch_size_of(batch) * topology.data_parallel_size,
                "nodes": trainer.num_nodes,
            }
            if topology.stages_per_rank > 1:
                config["stages_per_rank"] = topology.stages_per_rank
            trace = chrome_trace(self.spans, title, {"config": config})
            self._storage.write_bytes(self.path, trace.encode())


def _varuna(trainer: pl.Trainer) -> RecordsTimeline:
    if not isinstance(trainer.strategy, RecordsTimeline):
        raise TypeError(f"PipelineTrace records VarunaStrategy's pipeline; this Trainer runs {trainer.strategy}.")
    return trainer.strategy
