"""What `VarunaStrategy` plans by as it starts: the fastest configuration for the job's processes (the sizes it was
asked to choose, or training spilled on one device) and the seconds of each segment that the stages are balanced by.
Both come from a profile written by ``lightning-varuna profile``; without one the segments are timed at start-up. Rank
0 decides, every rank gets its answer."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_varuna.profiling.autoconfig import choose_configs, describe_choice, format_ranking
from lightning_varuna.profiling.profile import ModelProfile, segment_costs
from lightning_varuna.profiling.segments import measure_segments
from lightning_varuna.profiling.simulator import Config
from lightning_varuna.profiling.spilled import SpilledConfig
from lightning_varuna.storage import Storage

__all__ = ["ModelCosts"]


class ModelCosts:
    """The costs of one model, from its profile or measured.

    Args:
        profile: the URL of a profile (`ModelProfile`), read once; ``None``: the segments are timed at start-up.
        storage: where ``profile`` is read from.
        repeats: the steps timed per segment without a profile.
    """

    def __init__(self, profile: str | None, storage: Storage, repeats: int) -> None:
        self.url, self._storage, self._repeats = profile, storage, repeats

    @cached_property
    def profile(self) -> ModelProfile:
        """The profile, read once (by the auto-configuration and the cut)."""
        assert self.url is not None
        return ModelProfile.load(self.url, self._storage)

    def choose_config(
        self,
        world_size: int,
        device: torch.device,
        nodes: int,
        *,
        global_batch_size: int | None,
        pipeline_parallel_size: int | None,
        data_parallel_size: int | None,
        micro_batch_size: int | None,
        schedule: str | None,
        stages_per_rank: int | None = None,
        memory_budget: int | None = None,
        spill_tiers: Sequence[str] = (),
    ) -> Config | SpilledConfig:
        """The fastest configuration of ``world_size`` processes on ``nodes`` that the simulator predicts for
        ``global_batch_size``, keeping the sizes given (``None``: free to choose; ``stages_per_rank`` binds V of an
        interleaved schedule) and fitting the smallest device of
        the job (``device`` is this process's) and ``memory_budget`` bytes per device; with a budget, on one process,
        training spilled to one of ``spill_tiers`` is a candidate too (`choose_configs`). Logged with the runner-up,
        their predicted step times and the top of the ranking. Collective.

        Raises:
            ValueError: on every rank, when none is feasible (says why).
        """
        assert global_batch_size is not None, "the auto-configuration keeps a global batch"
        memory = _smallest_device_memory(device, world_size)
        if memory_budget is not None:
            memory = memory_budget if memory is None else min(memory, memory_budget)
        choice: Any = None
        if dist.get_rank() == 0:
            try:
                ranked = choose_configs(
                    self.profile,
                    world_size,
                    global_batch_size,
                    pipeline_parallel_size=pipeline_parallel_size,
                    data_parallel_size=data_parallel_size,
                    micro_batch_size=micro_batch_size,
                    schedule=schedule,
                    stages_per_rank=stages_per_rank,
                    memory_bytes=memory,
                    nodes=nodes,
                    spill_tiers=spill_tiers,
                )
                choice = ranked[0].config, describe_choice(ranked), format_ranking(ranked, 5)
            except ValueError as error:  # every rank raises it, none waits for a choice
                choice = str(error)
        choice = _from_rank_zero(choice)
        if isinstance(choice, str):
            raise ValueError(choice)
        best, why, table = choice
        rank_zero_info(f"VarunaStrategy, {world_size} processes: AutoConfig {why}\n{table}")
        return best

    def segment_costs(
        self,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        cutpoints: list[str],
        *,
        micro_batch_size: int,
        processes_per_node: int,
    ) -> list[float]:
        """Forward + backward seconds of each segment of ``module`` (called with one micro-batch, ``args`` and
        ``kwargs``): from the profile if there is one, else measured now on rank 0. Collective.

        Raises:
            ValueError: the profile is of a model with other CutPoints than ``cutpoints``.
        """
        if self.url is None:
            timed = measure_segments(module, args, kwargs, self._repeats, cutpoints) if dist.get_rank() == 0 else None
            return _from_rank_zero(segment_costs(timed) if timed is not None else None)
        profile = self.profile
        if profile.cutpoints != cutpoints:
            raise ValueError(
                f"The profile {self.url} was taken of a model with CutPoints {profile.cutpoints}, but this one "
                f"calls {cutpoints}; profile it again (`lightning-varuna profile`)."
            )
        return profile.segment_costs(profile.threads_per_process(processes_per_node), micro_batch_size)


def _smallest_device_memory(device: torch.device, world_size: int) -> int | None:
    """The memory of the job's smallest GPU; ``None`` on CPUs. Collective."""
    if device.type != "cuda":
        return None
    memories: list[Any] = [None] * world_size
    dist.all_gather_object(memories, torch.cuda.get_device_properties(device).total_memory)
    return min(memories)


def _from_rank_zero(obj: Any) -> Any:
    objects = [obj]
    dist.broadcast_object_list(objects, 0)
    return objects[0]
