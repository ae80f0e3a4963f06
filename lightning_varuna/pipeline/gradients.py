"""Keep a stage's replicas in step: its gradients summed over them (the one all-reduce of every training step) and
its buffers taken from the first replica."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lightning_varuna._torch_private import flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["broadcast_buffers", "sum_gradients"]


def sum_gradients(grads: list[Tensor], group: dist.ProcessGroup | None, replicas: int) -> list[Tensor]:
    """Sum ``grads`` over the ``replicas`` of ``group`` in one flat all-reduce (with one replica: ``grads``)."""
    if not grads or replicas == 1:
        return grads
    flat = flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    return list(unflatten_dense_tensors(flat, grads))


def broadcast_buffers(buffers: list[Tensor], group: dist.ProcessGroup | None, src: int, replicas: int) -> None:
    """Give every replica the buffers of global rank ``src`` (BatchNorm's running statistics), as DDP does with
    ``broadcast_buffers=True``: each replica updated them from its own micro-batches, and the replicas must hold one
    model."""
    if not buffers or replicas == 1:
        return
    for buffer in buffers:
        dist.broadcast(buffer, src, group=group)
