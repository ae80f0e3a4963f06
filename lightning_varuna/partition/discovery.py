"""Find the CutPoints a forward pass goes through, check them, and time the segments between them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_varuna.cutpoint import CutPoint
from lightning_varuna.pipeline.microbatch import batch_size_of
from lightning_varuna.profiling.memory import SavedTensorMeter

__all__ = [
    "SegmentProfile",
    "buffers_kept",
    "discover_cutpoints",
    "forward_with_cutpoints",
    "profile_segments",
    "timed_pass",
]


@dataclass(frozen=True)
class SegmentProfile:
    """Measured cost of the segments between consecutive cutpoints of one forward + backward.

    Segment ``i`` runs from cutpoint ``i - 1`` (or the model input) to cutpoint ``i`` (or the output),
    so there is one segment more than there are cutpoints.
    """

    cutpoint_names: list[str]
    forward_seconds: list[float]
    backward_seconds: list[float]

    @property
    def num_segments(self) -> int:
        return len(self.cutpoint_names) + 1

    @property
    def costs(self) -> list[float]:
        """Forward + backward seconds of each segment."""
        return [f + b for f, b in zip(self.forward_seconds, self.backward_seconds)]


@contextmanager
def _observe_cutpoints(module: nn.Module, batch_size: int, on_call: Any = None) -> Iterator[list[str]]:
    """Record the names of the cutpoints called during a forward, checking each call's input."""
    names = {cut: name for name, cut in module.named_modules() if isinstance(cut, CutPoint)}
    order: list[str] = []

    def observe(cut: CutPoint, x: object) -> None:
        name = names[cut]
        if name in order:
            raise ValueError(
                f"CutPoint `{name}` was called twice in one forward. Each CutPoint marks one place: "
                "create one CutPoint instance per call site (e.g. one per block in an `nn.ModuleList`)."
            )
        if not isinstance(x, Tensor):
            raise TypeError(
                f"CutPoint `{name}` got a `{type(x).__name__}`; its input must be one tensor whose dim 0 is "
                "the batch. Move the CutPoint to where a single activation tensor flows between blocks."
            )
        if x.dim() == 0 or x.shape[0] != batch_size:
            raise ValueError(
                f"CutPoint `{name}` got a tensor of shape {tuple(x.shape)} but the batch size is {batch_size}: "
                "its input must keep the batch as dim 0."
            )
        order.append(name)
        if on_call is not None:
            on_call(x)

    for cut in names:
        cut._observer = observe
    try:
        yield order
    finally:
        for cut in names:
            cut._observer = None


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Put every buffer back as it was after the block: passes that only look at the model (finding the CutPoints,
    timing the segments) must not move BatchNorm's running statistics, or the trained model differs from one
    device's."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def discover_cutpoints(module: nn.Module, args: tuple, kwargs: dict | None = None) -> list[str]:
    """Run one forward without gradients and return the names of the cutpoints it went through, in order."""
    return forward_with_cutpoints(module, args, kwargs)[0]


def forward_with_cutpoints(module: nn.Module, args: tuple, kwargs: dict | None = None) -> tuple[list[str], Any]:
    """Run one forward without gradients; return the cutpoints it went through, in order, and its output."""
    with torch.no_grad(), buffers_kept(module), _observe_cutpoints(module, batch_size_of((args, kwargs))) as order:
        output = module(*args, **(kwargs or {}))
    return order, output


def _float_leaves(output: Any) -> list[Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]


def timed_pass(module: nn.Module, args: tuple, kwargs: dict, meter: SavedTensorMeter | None = None) -> dict[str, list]:
    """One forward + backward, timed at every CutPoint.

    Returns:
        Per segment: ``forward`` and ``backward`` seconds, ``saved`` bytes autograd kept for backward (with a
        ``meter``; zeros without) and ``outputs``, the bytes of the activation at its closing CutPoint.
    """
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

    with measuring, _observe_cutpoints(module, batch_size_of((args, kwargs)), on_call=at_cutpoint):
        start = time.perf_counter()
        output = module(*args, **kwargs)
        forward_end = time.perf_counter()
        saved_end = meter.bytes
    leaves = _float_leaves(output)
    if leaves:
        torch.autograd.backward([t.float().sum() for t in leaves])
    backward_end = time.perf_counter()
    module.zero_grad(set_to_none=True)
    bounds = [start, *marks, forward_end]
    forward = [b - a for a, b in zip(bounds, bounds[1:])]
    saved_bounds = [0, *saved_at, saved_end]
    saved = [b - a for a, b in zip(saved_bounds, saved_bounds[1:])]
    if len(backward_marks) == len(marks):
        back_bounds = [forward_end, *backward_marks, backward_end]
        backward = [b - a for a, b in zip(back_bounds, back_bounds[1:])][::-1]
    else:
        backward = [2 * f for f in forward]  # no gradient flows through some CutPoint: estimate
    return {"forward": forward, "backward": backward, "saved": saved, "outputs": [*outputs, 0]}


def profile_segments(module: nn.Module, args: tuple, kwargs: dict | None = None, *, repeats: int = 3) -> SegmentProfile:
    """Time forward and backward of every segment between cutpoints (median of ``repeats`` steps)."""
    kwargs = kwargs or {}
    order = discover_cutpoints(module, args, kwargs)
    with buffers_kept(module):
        timed_pass(module, args, kwargs)  # warm-up: allocator, lazy init
        runs = [timed_pass(module, args, kwargs) for _ in range(repeats)]
    forward = [statistics.median(r["forward"][i] for r in runs) for i in range(len(order) + 1)]
    backward = [statistics.median(r["backward"][i] for r in runs) for i in range(len(order) + 1)]
    return SegmentProfile(cutpoint_names=order, forward_seconds=forward, backward_seconds=backward)
