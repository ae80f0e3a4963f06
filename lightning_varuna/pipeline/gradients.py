"""Everything done to a stage's gradients after its pipelined backward: summed over the replicas (the one all-reduce
of every optimizer step) and over the stages that hold a tied weight, clipped by the norm over all stages, and
checked for fp16 overflow on every stage together; and the replicas' BatchNorm statistics kept equal. `GradientPhase`
does it all for a stage, in the order of a training step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_varuna._torch_private import flatten_dense_tensors, unflatten_dense_tensors
from lightning_varuna.pipeline.batch_norm import running_statistics
from lightning_varuna.pipeline.shared_params import SharedParameters

if TYPE_CHECKING:
    from lightning_varuna.pipeline.stage import Stage
    from lightning_varuna.pipeline.topology import PipelineGroups, Topology

__all__ = [
    "GradientPhase",
    "LossScaler",
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


T = TypeVar("T")


class LossScaler(Protocol):
    """What `GradientPhase` needs of fp16's grad scaler (a ``ShardwiseGradScaler``)."""

    def scale(self, outputs: Tensor) -> Tensor: ...

    def note_found_inf(self, found: Tensor) -> None: ...


class GradientPhase:
    """A stage's gradients from its pipelined backward to the optimizer step.

    The pipelined step runs inside Lightning's ``training_step`` (`computing`); its gradients wait aside from
    Lightning's ``zero_grad`` (`StepGradients`) until Lightning's ``backward`` (`put_in_place`), which adds them to
    the parameters' own while Lightning accumulates batches without a step (`accumulating`), and otherwise reduces
    them all at once: summed over the replicas and the stages that hold a tied weight (each micro-batch's loss was
    weighted by its share of the step's rows, so the sum is the mean), the replicas' BatchNorm statistics made the
    first replica's, an fp16 overflow agreed on by every stage. Clipping by norm (`clip_by_global_norm`) takes the
    norm over all stages.

    Args:
        stage: this rank's stage.
        topology: this rank's place in the job.
        groups: the job's process groups.
        device: where this stage computes.
        on_wait: called while a collective waits for a peer; it raises to give up (a peer failed, SIGTERM).
        scaler: fp16's grad scaler, told whether any stage's gradients overflowed; ``None``: nothing to agree on.
    """

    def __init__(
        self,
        stage: Stage,
        topology: Topology,
        groups: PipelineGroups,
        device: torch.device,
        on_wait: Callable[[], None],
        scaler: LossScaler | None = None,
    ) -> None:
        self._stage, self._topology, self._groups, self._device = stage, topology, groups, device
        self._on_wait, self._scaler = on_wait, scaler
        if scaler is not None and not topology.is_last_stage:
            # Only the last stage scales a loss; scaling nothing gives the others' scalers the scale unscale_ needs.
            scaler.scale(torch.zeros((), device=device))
        self._step_gradients = StepGradients()
        self._accumulating = False  # while Lightning accumulates a batch without an optimizer step

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Inside the block (the pipelined step) the stage's parameters collect one step's gradients alone."""
        with self._step_gradients.computing(self._stage.own_parameters()):
            yield

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Inside the block (Lightning's ``block_backward_sync``, as DDP's ``no_sync``) `put_in_place` sums the
        gradients locally; they are reduced once, with the last batch's."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def put_in_place(self) -> None:
        """Give the stage's parameters the step's gradients, reduced unless `accumulating`. Collective."""
        # Not frozen or unused ones: without a gradient, as on one device, an optimizer leaves them alone (a zero
        # gradient would take AdamW's weight decay).
        params = self._stage.trained_parameters()
        if self._accumulating:
            self._step_gradients.accumulate(params)
            return
        replicas = self._topology.data_parallel_size
        # The gradients of earlier accumulated batches are not reduced yet: reduce them all at once.
        grads = self._step_gradients.gradients_with(params)
        start = time.time()
        grads = self._wait(lambda: reduce_gradients(params, grads, self._groups.replicas, replicas, self._stage.shared))
        timeline = self._stage.runtime.timeline
        if timeline is not None:
            timeline.append(("all-reduce", start, time.time()))
        for p, g in zip(params, grads):
            p.grad = g
        statistics = running_statistics(self._stage.module) if replicas > 1 else []
        if statistics:
            first = self._topology.replica_ranks()[0]
            self._wait(lambda: broadcast_buffers(statistics, self._groups.replicas, first, replicas))
        if self._scaler is not None:  # every stage's scaler skips a step that overflowed on any
            self._scaler.note_found_inf(self._wait(lambda: agree_on_overflow(params, self._device)))

    def clip_by_global_norm(self, max_norm: float) -> None:
        """Clip the stage's gradients by the norm over the gradients of all stages, as on one device. Collective."""
        params = self._stage.own_parameters()
        counted = self._stage.shared.counted_once(params)
        stages = self._topology.pipeline_parallel_size
        self._wait(lambda: clip_grad_norm_across_stages(params, counted, max_norm, self._groups.stages, stages))

    def _wait(self, collectives: Callable[[], T]) -> T:
        """``collectives()``, given up as a pipeline message is (`Waiter`): a peer that gave up its step never
        joins them."""
        return self._stage.runtime.waiter.call(collectives, self._on_wait)
