"""Everything done to a stage's gradients after its pipelined backward: summed over the replicas (the one all-reduce
of every optimizer step) and over the stages that hold a tied weight, clipped by the norm over all stages, and
checked for fp16 overflow on every stage together; and the replicas' BatchNorm statistics kept equal."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_varuna._torch_private import flatten_dense_tensors, unflatten_dense_tensors
from lightning_varuna.pipeline.shared_params import SharedParameters

__all__ = [
    "StepGradients",
    "agree_on_overflow",
    "broadcast_buffers",
    "clip_grad_norm_across_stages",
    "reduce_gradients",
    "sum_gradients",
]


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


def reduce_gradients(
    params: list[Tensor], grads: list[Tensor], group: dist.ProcessGroup | None, replicas: int, shared: SharedParameters
) -> list[Tensor]:
    """``grads`` of ``params`` summed over the replicas and, for tied weights, over the stages that hold them."""
    grads = sum_gradients(grads, group, replicas)
    shared.sum_across_stages(dict(zip(params, grads)))
    return grads


def clip_grad_norm_across_stages(
    params: list[Tensor], counted: list[Tensor], max_norm: float, group: dist.ProcessGroup | None, stages: int
) -> Tensor:
    """Clip the gradients of ``params`` by the norm over the gradients of all stages, as on one device.

    ``counted`` are the parameters whose gradients count towards this stage's share of the norm (a tied weight counts
    on one stage only). One all-reduce over the stages, as torchtitan does for its pipeline. Returns the total norm.
    """
    local = torch.nn.utils.get_total_norm([p.grad for p in counted if p.grad is not None])
    squared = local.float().pow(2)
    if stages > 1:
        dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
    return total


def agree_on_overflow(params: list[Tensor], device: torch.device) -> Tensor:
    """Whether any stage's gradients overflowed (fp16): 1 or 0, the same on every rank."""
    overflowed = any(not torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    found = torch.tensor(float(overflowed), device=device)
    dist.all_reduce(found, op=ReduceOp.MAX)
    return found


class StepGradients:
    """The gradients of a pipelined step, kept aside from Lightning's ``zero_grad``.

    The pipeline runs backward inside Lightning's ``training_step``; Lightning then zeroes the gradients (at the
    first batch it accumulates) before it calls the strategy's ``backward``. The step's gradients wait here and
    join those of earlier accumulated batches in `gradients_with`.
    """

    def __init__(self) -> None:
        self._step: dict[Tensor, Tensor] = {}

    @contextmanager
    def computing(self, params: list[Tensor]) -> Iterator[None]:
        """Inside the block ``params`` collect this step's gradients alone; after it they are as before."""
        earlier = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        try:
            yield
            self._step = {p: p.grad for p in params if p.grad is not None}
        finally:
            for p in params:
                p.grad = earlier[p]

    def accumulate(self, params: list[Tensor]) -> None:
        """Add the step's gradients to ``params``' own (a batch accumulated without an optimizer step)."""
        step, self._step = self._step, {}
        for p in params:
            if p in step:
                p.grad = step[p] if p.grad is None else p.grad + step[p]

    def gradients_with(self, params: list[Tensor]) -> list[Tensor]:
        """The step's gradients plus those ``params`` hold from earlier accumulated batches (zeros if neither)."""
        step, self._step = self._step, {}
        return [_sum_present(p.grad, step.get(p), p) for p in params]


def _sum_present(a: Tensor | None, b: Tensor | None, like: Tensor) -> Tensor:
    if a is None or b is None:
        present = a if b is None else b
        return torch.zeros_like(like) if present is None else present
    return a + b
