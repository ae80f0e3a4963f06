"""The stages of a pipeline replica must read the same batch: each runs its part of the model on it (the first stage
its inputs, the last stage its targets). VarunaStrategy's own sampler deals batches by data-parallel rank; a user's
`IterableDataset` split by the global rank (as under DDP) gives every stage a batch of its own, and the pipeline
would silently train on inputs and targets of different batches."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_leaves

__all__ = ["check_stages_read_one_batch"]


def check_stages_read_one_batch(
    batch: Any, stages: dist.ProcessGroup | None, stage_count: int, device: torch.device
) -> None:
    """Raise on every stage of this replica if they did not all read ``batch`` (compared by a fingerprint: its
    tensors' count, sizes and sums). Collective over ``stages``."""
    tensors = [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
    mine = torch.tensor(
        [len(tensors), sum(t.numel() for t in tensors), float(sum(t.detach().double().sum() for t in tensors))],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.empty_like(mine) for _ in range(stage_count)]
    dist.all_gather(gathered, mine, group=stages)
    if any(not torch.equal(other, mine) for other in gathered):
        raise ValueError(
            "The pipeline stages of one replica read different batches: each stage runs its part of the model on "
            "the same batch, so every rank of a replica must load the same data. Split an IterableDataset by the "
            "data-parallel rank (`trainer.strategy.topology.dp_rank`, of `data_parallel_size`), not the global rank."
        )
