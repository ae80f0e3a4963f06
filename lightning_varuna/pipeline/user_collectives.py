"""The collectives that user code calls through the strategy (``self.all_gather``, ``self.log(sync_dist=True)``, a
torchmetrics metric's ``compute()``, ``trainer.strategy.broadcast``) and the ranks they run over in a pipeline."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.distributed import group as _group
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_varuna._lightning_private import distributed_is_initialized, sync_ddp_if_available
from lightning_varuna.pipeline.module_hooks import metrics_synced_over
from lightning_varuna.pipeline.step_logging import STAGE_REPLICAS
from lightning_varuna.pipeline.topology import PipelineGroups, Topology

__all__ = ["UserCollectives"]


class UserCollectives:
    """Runs the collectives of user code over all ranks; inside an epoch-end hook, which runs on the last stages alone
    (`module_hooks`), over the last stages of the replicas (`over_last_stages`); for a replayed ``sync_dist`` value
    (`STAGE_REPLICAS`), over the replicas of this rank's stage.

    Args:
        topology: this rank's place in the job; ``None`` before the job is laid out (all ranks, as one group).
        groups: the job's process groups.
    """

    def __init__(self, topology: Topology | None = None, groups: PipelineGroups | None = None) -> None:
        self._topology = topology
        self._groups = groups if groups is not None else PipelineGroups(None, None, (None, None))
        self._last_stages: dist.ProcessGroup | None = None  # inside an epoch-end hook (None: all ranks)

    def group(self, group: Any | None) -> Any | None:
        """The group of a collective that user code calls over all ranks (``group`` None or WORLD, as
        ``LightningModule.all_gather`` passes it): all ranks', or the last stages' inside an epoch-end hook; for
        `STAGE_REPLICAS`, the replicas of this rank's stage."""
        if group == STAGE_REPLICAS:
            return self._groups.replicas
        if self._last_stages is not None and group in (None, dist.group.WORLD):
            return self._last_stages
        return group

    def barrier(self) -> None:
        """Wait for every rank of the current group."""
        if distributed_is_initialized():
            dist.barrier(self._last_stages)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of global rank ``src``; inside an epoch-end hook, of the last stage of ``src``'s replica."""
        if not distributed_is_initialized():
            return obj
        objects = [obj]
        if self._last_stages is None:
            dist.broadcast_object_list(objects, src, group=_group.WORLD)
        else:
            assert self._topology is not None
            last_stage = self._topology.replica_ranks()[src // self._topology.pipeline_parallel_size]
            dist.broadcast_object_list(objects, last_stage, group=self._last_stages)
        return objects[0]

    def reduce(self, tensor: Any, group: Any | None, reduce_op: ReduceOp | str | None) -> Any:
        """``tensor`` reduced over the ranks of `group`; anything else as it is."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, self.group(group), reduce_op=reduce_op)
        return tensor

    @contextmanager
    def over_last_stages(self, module: pl.LightningModule) -> Iterator[None]:
        """Inside, the collectives that user code calls (``module``'s torchmetrics metrics' too) run over the last
        stages of the replicas."""
        self._last_stages = self._groups.replicas
        try:
            with metrics_synced_over(module, self._groups.replicas):
                yield
        finally:
            self._last_stages = None

    def gather_from_stages(self, obj: Any) -> list[Any]:
        """What every stage of this replica gives, in stage order. Collective over the replica's stages."""
        assert self._topology is not None
        stage_ranks = self._topology.stage_ranks()
        gathered: list[Any] = [None] * len(stage_ranks)
        dist.all_gather_object(gathered, obj, group=self._groups.stages)
        in_rank_order = sorted(stage_ranks)  # a group's ranks count its members by global rank
        return [gathered[in_rank_order.index(rank)] for rank in stage_ranks]
