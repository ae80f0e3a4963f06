"""Sum a stage's gradients over its data-parallel replicas: the one all-reduce of every training step."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lightning_varuna._torch_private import flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["sum_gradients"]


def sum_gradients(grads: list[Tensor], group: dist.ProcessGroup | None, replicas: int) -> list[Tensor]:
    """Sum ``grads`` over the ``replicas`` of ``group`` in one flat all-reduce (with one replica: ``grads``)."""
    if not grads or replicas == 1:
        return grads
    flat = flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    return list(unflatten_dense_tensors(flat, grads))
