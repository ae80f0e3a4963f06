"""Rank arithmetic of a pipeline x data-parallel job and the process groups it needs.

Global rank ``r`` runs stage ``P - 1 - r % P`` of replica ``r // P``: the stages of one replica are neighbours,
so point-to-point traffic stays on a node and only the gradient all-reduce crosses nodes. They are numbered from
the last, so that rank 0 holds the last stage of replica 0: the one that computes the loss and runs the epoch-end
hooks, where the user's rank-zero code (loggers, ``@rank_zero_only``, ``self.print``) sees what it logs.

With ``stages_per_rank`` V > 1 (interleaved schedules) the model is cut into P x V stages, round-robin: stage ``s`` runs
on the rank of pipeline position ``s % P``, so position 0 holds stages 0, P, 2P, ... and the last stage is still on the
last position (global rank 0 for replica 0). With ``v_shape`` (the ZBV schedule: two stages per rank) position ``p``
holds stages ``p`` and ``2P - 1 - p``: the last stage is on position 0, so there global rank ``r`` is position
``r % P`` and rank 0 still holds the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lightning_varuna.pipeline.schedules import rank_of_stage, stages_of_rank

__all__ = ["PipelineGroups", "Topology"]


@dataclass(frozen=True)
class Topology:
    pipeline_parallel_size: int
    data_parallel_size: int
    rank: int
    stages_per_rank: int = 1
    v_shape: bool = False  # stages placed in a V (`stages_of_rank`), not round-robin

    @classmethod
    def from_world(
        cls,
        world_size: int,
        rank: int,
        pipeline_parallel_size: int,
        data_parallel_size: int | None,
        stages_per_rank: int = 1,
        v_shape: bool = False,
    ) -> Topology:
        """Check that the world factors into pipeline x data parallel and return this rank's place in it."""
        if pipeline_parallel_size < 1:
            raise ValueError(f"`pipeline_parallel_size={pipeline_parallel_size}` must be a positive integer.")
        if stages_per_rank < 1:
            raise ValueError(f"`stages_per_rank={stages_per_rank}` must be a positive integer.")
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
        return cls(pipeline_parallel_size, inferred, rank, stages_per_rank, v_shape)

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline: the stage it runs (with one stage per rank)."""
        return self._position(self.rank % self.pipeline_parallel_size)

    @property
    def num_stages(self) -> int:
        """The stages the model is cut into: ``pipeline_parallel_size`` x ``stages_per_rank``."""
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def stage_indices(self) -> tuple[int, ...]:
        """The stages this rank runs, in order: ``pp_rank``, ``pp_rank + P``, ... (in a V: ``pp_rank``,
        ``2P - 1 - pp_rank``)."""
        return stages_of_rank(self.pp_rank, self.pipeline_parallel_size, self.stages_per_rank, self.v_shape)

    def pp_rank_of(self, stage: int) -> int:
        """The pipeline position that runs ``stage``."""
        return rank_of_stage(stage, self.pipeline_parallel_size, self.v_shape)

    @property
    def last_stage_position(self) -> int:
        """The pipeline position that runs the last stage (which computes the loss)."""
        return self.pp_rank_of(self.num_stages - 1)

    def ranks_of_stages(self, dp_rank: int | None = None) -> list[int]:
        """Global rank of each stage of one replica (default: this rank's), in stage order (`num_stages` of them)."""
        ranks = self.stage_ranks(dp_rank)
        return [ranks[self.pp_rank_of(s)] for s in range(self.num_stages)]

    @property
    def dp_rank(self) -> int:
        """The data-parallel replica this rank belongs to."""
        return self.rank // self.pipeline_parallel_size

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (with several stages per rank: among its own)."""
        return self.pp_rank == self.last_stage_position

    def stage_ranks(self, dp_rank: int | None = None) -> list[int]:
        """Global ranks of the positions of one replica's pipeline (default: this rank's), in order (with one stage
        per rank: of its stages)."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        return [self._rank_of(dp_rank, s) for s in range(self.pipeline_parallel_size)]

    def replica_ranks(self, pp_rank: int | None = None) -> list[int]:
        """Global ranks that hold the same stage in every replica (default: this rank's stage)."""
        pp_rank = self.pp_rank if pp_rank is None else pp_rank
        return [self._rank_of(d, pp_rank) for d in range(self.data_parallel_size)]

    def _rank_of(self, dp_rank: int, pp_rank: int) -> int:
        return dp_rank * self.pipeline_parallel_size + self._position(pp_rank)

    def _position(self, index: int) -> int:
        """The pipeline position of a replica's ``index``-th rank (by global rank), and the other way round: the
        replica's first rank holds the position of the last stage."""
        return index if self.v_shape else self.pipeline_parallel_size - 1 - index

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
