"""Measure each CutPoint segment of a model: forward, backward and recompute time, activation and parameter memory."""

from __future__ import annotations

import hashlib
import inspect
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map
from tqdm.auto import tqdm

from lightning_varuna.data.microbatch import batch_size_of
from lightning_varuna.partition.discovery import buffers_kept, discover_cutpoints, observe_cutpoints
from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.partition.split import PipelineGraph, split_into_stages
from lightning_varuna.pipeline.batch_norm import normalizes_over_the_batch, one_value_per_channel_refused
from lightning_varuna.profiling.profile import ModelProfile, ProfiledSegment, SegmentTiming
from lightning_varuna.profiling.segments import float_leaves, measure_segments, measure_split_backward, timed_pass

__all__ = ["default_thread_counts", "profile_model", "resize_batch"]


def default_thread_counts(processes_per_node: int) -> list[int]:
    """The CPU thread counts a process gets (cores // processes) for every process count up to the given one."""
    cores = os.cpu_count() or 1
    return sorted({max(1, cores // n) for n in range(1, processes_per_node + 1)})


def resize_batch(inputs: Any, rows: int) -> Any:
    """The forward inputs with ``rows`` rows: the first rows, repeated when there are fewer. Only tensors whose
    dim 0 is the batch are resized (as micro-batching does); the results own their memory."""
    batch = batch_size_of(inputs)

    def resize(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        repeats = -(-rows // batch)
        return t.repeat(repeats, *([1] * (t.dim() - 1)))[:rows].clone()

    return tree_map(resize, inputs)


def profile_model(
    module: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    micro_batch_sizes: Sequence[int] | None = None,
    thread_counts: Sequence[int] | None = None,
    repeats: int = 5,
    previous: ModelProfile | None = None,
    progress: bool = True,
) -> ModelProfile:
    """Time and size every segment between the model's CutPoints for each micro-batch size and thread count.

    Args:
        module: the model; its forward is called with ``args``/``kwargs`` resized to each micro-batch size.
        micro_batch_sizes: micro-batch sizes to measure (the simulator interpolates between them); by default
            1, 2, 4 and 8, from 2 for a model with BatchNorm (which may not train on one row).
        thread_counts: CPU threads per process to measure at (default: every ``cores // processes``).
        repeats: timed passes per measurement (the fastest is kept).
        previous: an earlier profile of the same model: what it already has (same segments, size and threads)
            is kept, not measured again.
        progress: show a progress bar.

    Returns:
        A profile without network measurements (see `profile_network`).
    """
    kwargs = kwargs or {}
    if micro_batch_sizes is None:
        micro_batch_sizes = (2, 4, 8) if normalizes_over_the_batch(module) else (1, 2, 4, 8)
    thread_counts = sorted(set(thread_counts or default_thread_counts(1)))
    cutpoints = discover_cutpoints(module, args, kwargs)
    with buffers_kept(module):
        segments, segment_params = _describe_segments(module, args, kwargs, cutpoints)
    fingerprints = [s.fingerprint for s in segments]
    same_model = previous is not None and [s.fingerprint for s in previous.segments] == fingerprints
    if previous is not None and same_model:
        for new, old in zip(segments, previous.segments):
            new.timings = {t: dict(by_mb) for t, by_mb in old.timings.items()}
            new.optimizer_step_s = dict(old.optimizer_step_s)
            new.optimizer_bytes = old.optimizer_bytes
    todo: list[tuple[int, int | None]] = [
        (t, mb)
        for t in thread_counts
        for mb in sorted(set(micro_batch_sizes))
        if mb not in segments[0].timings.get(t, {})
    ]
    todo += [(t, None) for t in thread_counts if t not in segments[0].optimizer_step_s]
    was_training, threads_before = module.training, torch.get_num_threads()
    module.train()
    traced: dict[int, tuple[PipelineGraph, nn.Module]] = {}
    advice = "Profile micro-batch sizes of 2 rows or more (`micro_batch_sizes=(2, 4, 8)`)."
    try:
        with buffers_kept(module), one_value_per_channel_refused(module, advice):
            for threads, mb in tqdm(todo, desc="Profiling segments", disable=not progress, unit="run"):
                torch.set_num_threads(threads)
                if mb is None:
                    small_args, small_kwargs = resize_batch((args, kwargs), min(micro_batch_sizes))
                    between = partial(timed_pass, module, small_args, small_kwargs, cutpoints=cutpoints)
                    _time_optimizer_steps(module, segments, segment_params, threads, between)
                    continue
                mb_args, mb_kwargs = resize_batch((args, kwargs), mb)
                timings = measure_segments(module, mb_args, mb_kwargs, repeats, cutpoints)  # eager: clearer errors
                splits = measure_split_backward(module, mb_args, mb_kwargs, repeats, cutpoints)
                timings = [replace(timing, split_shares=split) for timing, split in zip(timings, splits)]
                if mb not in traced:
                    traced[mb] = _trace_as_one_stage(module, mb_args, mb_kwargs)
                ratios = _runtime_ratio(module, traced[mb], mb_args, mb_kwargs, repeats)
                for segment, timing in zip(segments, timings):
                    segment.timings.setdefault(threads, {})[mb] = _scaled_time(timing, ratios)
    finally:
        torch.set_num_threads(threads_before)
        module.train(was_training)
        module.zero_grad(set_to_none=True)
    profile = ModelProfile(
        model=type(module).__name__,
        device=str(next(iter(module.parameters())).device),
        cores_per_node=os.cpu_count() or 1,
        segments=segments,
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
    )
    if previous is not None:  # the network and the spill tiers did not change with the model
        profile.p2p, profile.allreduce = dict(previous.p2p), dict(previous.allreduce)
        profile.object_broadcast = dict(previous.object_broadcast)
        profile.spill = dict(previous.spill)
        if same_model:  # what calibration learned about this model's step
            profile.overheads = dict(previous.overheads)
    return profile


# ------------------------------------------------------------------------------------------------ segments
def _describe_segments(
    module: nn.Module, args: tuple, kwargs: dict, cutpoints: list[str]
) -> tuple[list[ProfiledSegment], list[list[Tensor]]]:
    """The parameters each segment uses (those of every module it calls) and its fingerprint: the modules,
    parameter shapes and the shape of one input row, so a changed model or sequence length is measured again."""
    order: list[str] = []
    calls: dict[nn.Module, set[int]] = {}

    def note(mod: nn.Module, _: Any) -> None:
        calls.setdefault(mod, set()).add(len(order))

    handle = nn.modules.module.register_module_forward_pre_hook(note)
    try:
        with (
            torch.no_grad(),
            observe_cutpoints(module, batch_size_of((args, kwargs)), lambda x: None, cutpoints) as order,
        ):
            module(*args, **kwargs)
    finally:
        handle.remove()
    num_segments = len(order) + 1
    canonical = {p: name for name, p in module.named_parameters()}
    params: list[dict[str, Tensor]] = [{} for _ in range(num_segments)]
    kinds: list[list[str]] = [[] for _ in range(num_segments)]
    parents = {child: parent for parent in module.modules() for child in parent.children()}
    for sub in module.modules():
        for segment in sorted(_segments_of(sub, calls, parents)):
            kinds[segment].append(type(sub).__name__)
            for p in sub.parameters(recurse=False):
                params[segment][canonical[p]] = p  # a tied or reused weight counts in every segment using it
    row_shapes = [(tuple(t.shape[1:]), str(t.dtype)) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    result = []
    for i in range(num_segments):
        described = [(n, tuple(p.shape), str(p.dtype)) for n, p in params[i].items()]
        result.append(
            ProfiledSegment(
                name=order[i] if i < len(order) else "<output>",
                fingerprint=hashlib.sha1(repr((described, kinds[i], row_shapes)).encode()).hexdigest()[:16],
                parameters={n: p.numel() * p.element_size() for n, p in params[i].items()},
                optimizer_bytes=0,
            )
        )
    return result, [list(named.values()) for named in params]


def _segments_of(sub: nn.Module, calls: dict[nn.Module, set[int]], parents: dict[nn.Module, nn.Module]) -> set[int]:
    """The segments that call ``sub``; for a module never called itself, whose parent uses its parameters directly
    (``nn.MultiheadAttention``'s ``out_proj``), those of the nearest ancestor that is called (segment 0 if none)."""
    if sub in calls:
        return calls[sub]
    ancestor = parents.get(sub)
    while ancestor is not None and ancestor not in calls:
        ancestor = parents.get(ancestor)
    return calls[ancestor] if ancestor is not None else {0}


# ------------------------------------------------------------------------------------------------ timings
# --------------------------------------------------------------------------------------- runtime overhead
def _trace_as_one_stage(module: nn.Module, args: tuple, kwargs: dict) -> tuple[PipelineGraph, nn.Module]:
    """The traced module VarunaStrategy runs for a stage (here: the whole model as one stage)."""
    real: dict[str, Tensor] = dict(module.named_parameters())
    real.update(module.named_buffers())
    return split_into_stages(module, ModelSkeleton(module), real, args, kwargs, [], 0)


def _runtime_ratio(
    module: nn.Module, traced: tuple[PipelineGraph, nn.Module], args: tuple, kwargs: dict, repeats: int
) -> tuple[float, float]:
    """How much longer the traced stage module takes than the eager model: (forward, backward) ratios.

    The segments are timed in eager mode (where CutPoints can be observed); the pipeline runs the traced module,
    whose forward has a larger per-operation overhead (its backward is the same autograd graph). The simulator
    needs what the pipeline runs.
    """
    graph, stage = traced
    leaves = tree_leaves((args, kwargs))
    stage_args = [leaves[src.index] for src in graph.stage_inputs[0]]

    def eager() -> list[Tensor]:
        return float_leaves(module(*args, **kwargs))

    def pipelined() -> list[Tensor]:
        outputs = stage(*stage_args)
        return float_leaves(outputs if isinstance(outputs, tuple) else (outputs,))

    times = {}
    for name, forward in (("eager", eager), ("pipelined", pipelined)):
        forwards, backwards = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            outputs = forward()
            middle = time.perf_counter()
            torch.autograd.backward([t.float().sum() for t in outputs])
            backwards.append(time.perf_counter() - middle)
            forwards.append(middle - start)
            module.zero_grad(set_to_none=True)
        times[name] = (min(forwards[1:]), min(backwards[1:]))
    return (
        max(1.0, times["pipelined"][0] / times["eager"][0]),
        max(1.0, times["pipelined"][1] / times["eager"][1]),
    )


def _scaled_time(timing: SegmentTiming, ratios: tuple[float, float]) -> SegmentTiming:
    forward, backward = ratios
    return replace(
        timing,
        forward_s=timing.forward_s * forward,
        forward_no_grad_s=timing.forward_no_grad_s * forward,
        backward_s=timing.backward_s * backward,
    )


# ------------------------------------------------------------------------------------------------ optimizer
def _time_optimizer_steps(
    module: nn.Module,
    segments: list[ProfiledSegment],
    segment_params: list[list[Tensor]],
    threads: int,
    between: Callable[[], Any],
    repeats: int = 5,
) -> None:
    """Time the model's optimizer stepping each segment's parameters and size the state it keeps. Each step is timed
    after ``between`` (a forward and backward of the model), as in training, where the optimizer finds its state out
    of the caches the backward went through: timed back to back, a step of examples/gpt.py's GPT took 0.6x as long as
    in training on the CPU."""
    optimizer_cls, defaults = optimizer_of(module)
    for segment, all_params in zip(segments, segment_params):
        params = [p for p in all_params if p.requires_grad]
        if not params:
            segment.optimizer_step_s[threads] = 0.0
            continue
        with _scratch_copies(params) as copies:
            optimizer = optimizer_cls(copies, **defaults)
            times = []
            for _ in range(repeats + 1):
                between()
                start = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - start)
            state = [t for s in optimizer.state.values() for t in tree_leaves(s) if isinstance(t, Tensor)]
            segment.optimizer_bytes = sum(t.numel() * t.element_size() for t in state if t.dim() > 0)
        segment.optimizer_step_s[threads] = statistics.median(times[1:])


@contextmanager
def _scratch_copies(params: list[Tensor]) -> Iterator[list[nn.Parameter]]:
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for c in copies:
        c.grad = torch.full_like(c, 1e-3)
    yield copies


def optimizer_of(module: nn.Module) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and settings of the (first) optimizer of ``module``'s ``configure_optimizers``; AdamW without one."""
    configure = getattr(module, "configure_optimizers", None)
    found = configure() if configure is not None else None
    for _ in range(3):  # a list/tuple/dict of optimizers (and schedulers): take the first optimizer
        if isinstance(found, dict):
            found = found.get("optimizer")
        elif isinstance(found, (list, tuple)) and found:
            found = found[0]
    if not isinstance(found, torch.optim.Optimizer):
        return torch.optim.AdamW, {}
    accepted = inspect.signature(type(found)).parameters
    return type(found), {k: v for k, v in found.defaults.items() if k in accepted}
