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
from lightning_varuna.partition.discovery import buffers_kept, discover_cutpoints, observe_cutpoints
from lightning_varuna.pipeline.split_backward import SplitBackward
from lightning_varuna.profiling.memory import SavedTensorMeter
from lightning_varuna.profiling.profile import SegmentTiming

__all__ = ["TimedPass", "float_leaves", "measure_segments", "measure_split_backward", "timed_pass"]


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


def timed_pass(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    meter: SavedTensorMeter | None = None,
    cutpoints: list[str] | None = None,
) -> TimedPass:
    """One forward + backward, timed at every CutPoint (``cutpoints``: at those only; with ``meter``: the bytes
    autograd saves, too)."""
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

    with measuring, observe_cutpoints(module, batch_size_of((args, kwargs)), at_cutpoint, cutpoints):
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
    module: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    repeats: int = 3,
    cutpoints: list[str] | None = None,
) -> list[SegmentTiming]:
    """Each segment's timings from the fastest of ``repeats`` passes (the machine's speed when nothing else
    interferes: a busy neighbour slows some passes, never speeds one up) and the bytes it keeps and sends.
    The segments lie between ``cutpoints`` (by default `discover_cutpoints`'s).

    The model's buffers (BatchNorm's running statistics) are as before afterwards.
    """
    kwargs = kwargs or {}
    cutpoints = discover_cutpoints(module, args, kwargs) if cutpoints is None else cutpoints
    weights = [*module.parameters(), *module.buffers()]
    with buffers_kept(module):
        sized = timed_pass(module, args, kwargs, SavedTensorMeter(exclude=weights), cutpoints)  # also the warm-up
        runs = [timed_pass(module, args, kwargs, None, cutpoints) for _ in range(repeats)]  # without the meter
        fastest = min(runs, key=lambda run: run.total_s)
        fastest_no_grad = min((_forward_no_grad(module, args, kwargs, cutpoints) for _ in range(repeats)), key=sum)
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


def _forward_no_grad(module: nn.Module, args: tuple, kwargs: dict, cutpoints: list[str]) -> list[float]:
    marks: list[float] = []

    def mark(x: Tensor) -> None:
        marks.append(time.perf_counter())

    with torch.no_grad(), observe_cutpoints(module, batch_size_of((args, kwargs)), mark, cutpoints):
        start = time.perf_counter()
        module(*args, **kwargs)
        end = time.perf_counter()
    bounds = [start, *marks, end]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def measure_split_backward(
    module: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    repeats: int = 3,
    cutpoints: list[str] | None = None,
) -> list[tuple[float, float] | None]:
    """Each segment's backward split in two as the zero-bubble schedules split a stage's (`SplitBackward`): the
    input-gradient part and the weight part, each as a share of the segment's whole backward, from the fastest of
    ``repeats`` passes (None for a segment no gradient reaches). Each segment's input is cut from the graph (a leaf
    that takes a gradient), so that each part walks that segment's graph only, as a stage's parts walk the stage's.
    A segment whose input takes no gradient (the first) runs its whole backward in the weight part, as a first
    stage does. None for every segment where a value that takes a gradient goes past a CutPoint (a bias made before
    one and added after): cut apart, the segments would share its graph. The segments lie between ``cutpoints``
    (by default `discover_cutpoints`'s)."""
    kwargs = kwargs or {}
    cutpoints = discover_cutpoints(module, args, kwargs) if cutpoints is None else cutpoints
    splitter = SplitBackward()
    weights: dict[int, nn.ParameterList] = {}  # a module per segment: the splitter checks each once, untimed
    try:
        with buffers_kept(module):
            passes, splitting = repeats + 1, (splitter, weights)  # the first pass of each warms up
            whole = [_segment_backwards(module, args, kwargs, cutpoints) for _ in range(passes)][1:]
            split = [_segment_backwards(module, args, kwargs, cutpoints, splitting) for _ in range(passes)][1:]
    except RuntimeError as error:
        if "backward through the graph a second time" not in str(error):
            raise
        return [None] * (len(cutpoints) + 1)
    finally:
        module.zero_grad(set_to_none=True)
    shares: list[tuple[float, float] | None] = []
    for i in range(len(whole[0])):
        whole_s = min(run[i][0] for run in whole)
        input_s, weight_s = min((run[i] for run in split), key=sum)
        shares.append((input_s / whole_s, weight_s / whole_s) if whole_s > 0 else None)
    return shares


def _segment_backwards(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    cutpoints: list[str],
    split: tuple[SplitBackward, dict[int, nn.ParameterList]] | None = None,
) -> list[tuple[float, float]]:
    """A forward whose segments are cut apart at the CutPoints, then each segment's backward from the last, whole
    (without ``split``: (seconds, 0)) or split by ``split``'s splitter (the input part's and the weight part's
    seconds; its first pass checks each segment's split, untimed)."""
    outputs: list[Tensor] = []
    inputs: list[Tensor] = []

    def cut(x: Tensor) -> Tensor:
        outputs.append(x)
        inputs.append(x.detach().requires_grad_(x.requires_grad))
        return inputs[-1].clone()  # what follows may change it in place, which a leaf refuses

    with observe_cutpoints(module, batch_size_of((args, kwargs)), cut, cutpoints):
        output = module(*args, **kwargs)
    losses = [t.float().sum() for t in float_leaves(output)]
    segment_outputs = [[x] for x in outputs] + [losses]
    segment_inputs: list[list[Tensor]] = [[], *([x] if x.requires_grad else [] for x in inputs)]
    grads: list[Tensor] = [torch.ones_like(loss) for loss in losses]
    times: list[tuple[float, float]] = []
    for i in reversed(range(len(segment_outputs))):
        if not grads or not any(t.requires_grad for t in segment_outputs[i]):
            times.append((0.0, 0.0))
        elif split is not None:
            splitter, weights = split
            if i not in weights:
                weights[i] = nn.ParameterList(_parameters_reached(segment_outputs[i]))
                splitter.input_part(weights[i], segment_outputs[i], grads, segment_inputs[i])()  # checked, untimed
                times.append((0.0, 0.0))
            else:
                start = time.perf_counter()
                weight_pass = splitter.input_part(weights[i], segment_outputs[i], grads, segment_inputs[i])
                middle = time.perf_counter()
                weight_pass()
                times.append((middle - start, time.perf_counter() - middle))
        else:
            start = time.perf_counter()
            torch.autograd.backward(segment_outputs[i], grads)
            times.append((time.perf_counter() - start, 0.0))
        grads = [x.grad for x in segment_inputs[i] if x.grad is not None]
    module.zero_grad(set_to_none=True)
    return times[::-1]


def _parameters_reached(outputs: list[Tensor]) -> list[nn.Parameter]:
    """The parameters whose gradients a backward from ``outputs`` accumulates."""
    found: list[nn.Parameter] = []
    seen = set()
    nodes = [t.grad_fn for t in outputs]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, nn.Parameter):
            found.append(variable)
        nodes.extend(following for following, _ in node.next_functions)
    return found
