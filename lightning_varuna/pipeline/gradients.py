"""Average a stage's gradients over its data-parallel replicas: the one all-reduce of every training step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["average_gradients"]


def average_gradients(
    grads: list[Tensor], group: dist.ProcessGroup | None, replicas: int, scale: float
) -> list[Tensor]:
    """Sum ``grads`` over the ``replicas`` of ``group`` and multiply by ``scale``, in one flat all-reduce.

    With one replica and a scale of 1 the gradients are returned as they are (no copy).
    """
    if not grads or (replicas == 1 and scale == 1.0):
        return grads
    if replicas == 1:
        return [g * scale for g in grads]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    return list(torch._utils._unflatten_dense_tensors(flat, grads))
