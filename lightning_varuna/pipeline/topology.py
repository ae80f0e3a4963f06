"""Rank arithmetic of a pipeline x data-parallel job and the process groups it needs.

Global rank ``r`` runs stage ``P - 1 - r % P`` of replica ``r // P``: the stages of one replica are neighbours,
so point-to-point traffic stays on a node and only the gradient all-reduce crosses nodes. They are numbered from
the last, so that rank 0 holds the last stage of replica 0: the one that computes the loss and runs the epoch-end
hooks, where the user's rank-zero code (loggers, ``@rank_zero_only``, ``self.print``) sees what it logs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["PipelineGroups", "Topology"]


@dataclass(frozen=True)
class Topology:
    pipeline_parallel_size: int
    data_parallel_size: int
    rank: int

    @classmethod
    def from_world(
        cls, world_size: int, rank: int, pipeline_parallel_size: int, data_parallel_size: int | None
    ) -> Topology:
        """Check that the world factors into pipeline x data parallel and return this rank's place in it."""
        if pipeline_parallel_size < 1:
            raise ValueError(f"`pipeline_parallel_size={pipeline_parallel_size}` must be a positive integer.")
        if world_size % pipeline_parallel_size:
            raise ValueError(
                f"The world size {world_size} is not a multiple of `pipeline_parallel_size={pipeline_parallel_size}`."
                " Launch pipeline_parallel_size x data_parallel_size processes (`devices` x `num_nodes`)."
            )
        inferred = world_size // pipeline_parallel_size
        if data_parallel_size is not None and data_parallel_size != inferred:
            raise ValueError(
                f"The world size {world_size} is not pipeline_parallel_size x data_parallel_size = "
                f"{pipeline_parallel_size} x {data_parallel_size}. Launch "
                f"{pipeline_parallel_size * data_parallel_size} processes or leave `data_parallel_size` unset."
            )
        return cls(pipeline_parallel_size, inferred, rank)

    @property
    def pp_rank(self) -> int:
        """The pipeline stage this rank runs."""
        return self.pipeline_parallel_size - 1 - self.rank % self.pipeline_parallel_size

    @property
    def dp_rank(self) -> int:
        """The data-parallel replica this rank belongs to."""
        return self.rank // self.pipeline_parallel_size

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_parallel_size - 1

    def stage_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of the stages of one replica (default: this rank's), in stage order."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        return [self._rank_of(dp_rank, s) for s in range(self.pipeline_parallel_size)]

    def replica_ranks(self, pp_rank: int | None = None) -> list[int]:
        """Global ranks that hold the same stage in every replica (default: this rank's stage)."""
        pp_rank = self.pp_rank if pp_rank is None else pp_rank
        return [self._rank_of(d, pp_rank) for d in range(self.data_parallel_size)]

    def _rank_of(self, dp_rank: int, pp_rank: int) -> int:
        return dp_rank * self.pipeline_parallel_size + self.pipeline_parallel_size - 1 - pp_rank

    def new_groups(self, ranks_per_group: list[list[int]]) -> dist.ProcessGroup | None:
        """Create every group (all ranks must call this alike) and return the one holding this rank."""
        mine = None
        for ranks in ranks_per_group:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def process_groups(self) -> PipelineGroups:
        """Create the process groups of the pipeline x data-parallel layout (every rank must call this alike)."""
        replicas = self.new_groups([self.replica_ranks(s) for s in range(self.pipeline_parallel_size)])
        pipelines = [self.stage_ranks(d) for d in range(self.data_parallel_size)]
        stages = self.new_groups(pipelines)
        pipelined = self.pipeline_parallel_size > 1
        messages = (self.new_groups(pipelines), self.new_groups(pipelines)) if pipelined else (None, None)
        results = self.new_groups(pipelines) if pipelined else None
        return PipelineGroups(replicas, stages, messages, results)


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's process groups.

    Attributes:
        replicas: this stage's replicas (the gradient all-reduce, BatchNorm statistics).
        stages: this replica's stages (the global gradient norm, the step's results from the last stage).
        messages: this replica's stages again, one group for activations and one for gradients (see `StageRuntime`).
        results: this replica's stages again, for the step's results sent from the last stage (`StepResults`).
    """

    replicas: dist.ProcessGroup | None
    stages: dist.ProcessGroup | None
    messages: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]
    results: dist.ProcessGroup | None = None
