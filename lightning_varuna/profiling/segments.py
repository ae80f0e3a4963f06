"""Time and size the segments between a model's CutPoints: the one measurement behind both the cut a
`VarunaStrategy` makes at start-up and the profile that `lightning-varuna profile` writes for the simulator."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_varuna.data.microbatch import batch_size_of
from lightning_varuna.partition.discovery import buffers_kept, observe_cutpoints
from lightning_varuna.profiling.memory import SavedTensorMeter
from lightning_varuna.profiling.profile import SegmentTiming

__all__ = ["TimedPass", "float_leaves", "measure_segments", "timed_pass"]


@dataclass(frozen=True)
class TimedPass:
    """One forward + backward, per segment (one more than there are CutPoints)."""

    forward_s: list[float]
    backward_s: list[float]
    saved_bytes: list[int]  # what autograd kept for backward during the segment's forward (0 without a meter)
    output_bytes: list[int]  # the activation at the segment's closing CutPoint (0 for the last segment)

    @property
    def total_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s)


def float_leaves(output: Any) -> list[Tensor]:
    """The tensors of ``output`` that a backward can start from."""
    return [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]


def timed_pass(module: nn.Module, args: tuple, kwargs: dict, meter: SavedTensorMeter | None = None) -> TimedPass:
    """One forward + backward, timed at every CutPoint (with ``meter``: the bytes autograd saves, too)."""
    marks: list[float] = []
    saved_at: list[int] = []
    outputs: list[int] = []
    backward_marks: list[float] = []
    measuring = meter.measuring() if meter is not None else nullcontext()
    meter = meter or SavedTensorMeter()

    def at_cutpoint(x: Tensor) -> None:
        marks.append(time.perf_counter())
        saved_at.append(meter.bytes)
        outputs.append(x.numel() * x.element_size())
        if x.requires_grad:
            x.register_hook(lambda grad: backward_marks.append(time.perf_counter()))

    with measuring, observe_cutpoints(module, batch_size_of((args, kwargs)), on_call=at_cutpoint):
        start = time.perf_counter()
        output = module(*args, **kwargs)
        forward_end = time.perf_counter()
        saved_end = meter.bytes
    leaves = float_leaves(output)
    if leaves:
        torch.autograd.backward([t.float().sum() for t in leaves])
    backward_end = time.perf_counter()
    module.zero_grad(set_to_none=True)
    bounds = [start, *marks, forward_end]
    forward = [b - a for a, b in zip(bounds, bounds[1:])]
    saved_bounds = [0, *saved_at, saved_end]
    if len(backward_marks) == len(marks):
        back_bounds = [forward_end, *backward_marks, backward_end]
        backward = [b - a for a, b in zip(back_bounds, back_bounds[1:])][::-1]
    else:
        backward = [2 * f for f in forward]  # no gradient flows through some CutPoint: estimate
    return TimedPass(
        forward_s=forward,
        backward_s=backward,
        saved_bytes=[b - a for a, b in zip(saved_bounds, saved_bounds[1:])],
        output_bytes=[*outputs, 0],
    )


def measure_segments(
    module: nn.Module, args: tuple, kwargs: dict | None = None, repeats: int = 3
) -> list[SegmentTiming]:
    """Each segment's timings from the fastest of ``repeats`` passes (the machine's speed when nothing else
    interferes: a busy neighbour slows some passes, never speeds one up) and the bytes it keeps and sends.

    The model's buffers (BatchNorm's running statistics) are as before afterwards.
    """
    kwargs = kwargs or {}
    weights = [*module.parameters(), *module.buffers()]
    with buffers_kept(module):
        sized = timed_pass(module, args, kwargs, SavedTensorMeter(exclude=weights))  # also the warm-up
        runs = [timed_pass(module, args, kwargs) for _ in range(repeats)]  # timed without the meter's overhead
        fastest = min(runs, key=lambda run: run.total_s)
        fastest_no_grad = min((_forward_no_grad(module, args, kwargs) for _ in range(repeats)), key=sum)
    return [
        SegmentTiming(
            forward_s=fastest.forward_s[i],
            forward_no_grad_s=fastest_no_grad[i],
            backward_s=fastest.backward_s[i],
            activation_bytes=sized.saved_bytes[i],
            output_bytes=sized.output_bytes[i],
        )
        for i in range(len(fastest.forward_s))
    ]


def _forward_no_grad(module: nn.Module, args: tuple, kwargs: dict) -> list[float]:
    marks: list[float] = []
    with (
        torch.no_grad(),
        observe_cutpoints(module, batch_size_of((args, kwargs)), on_call=lambda x: marks.append(time.perf_counter())),
    ):
        start = time.perf_counter()
        module(*args, **kwargs)
        end = time.perf_counter()
    bounds = [start, *marks, end]
    return [b - a for a, b in zip(bounds, bounds[1:])]
