"""SpillingStrategy's set-up: cut a model at its CutPoints, measure each segment on a first batch, and pack the
segments into shards that fit a memory budget; the shards then start spilled."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map_only

from lightning_varuna.data.microbatch import batch_size_of, first_rows
from lightning_varuna.partition.discovery import buffers_kept, discover_cutpoints, observe_cutpoints
from lightning_varuna.partition.packing import (
    Packing,
    SegmentMemory,
    format_bytes,
    pack_shards,
    shard_share,
    smallest_budgets,
)
from lightning_varuna.partition.split import PipelineGraph, Source
from lightning_varuna.pipeline.replay import generator_states, states_differ
from lightning_varuna.profiling.memory import SavedTensorMeter
from lightning_varuna.spilling.folder import SpillFolder
from lightning_varuna.spilling.materialize import MetaModel, ParkedSegments
from lightning_varuna.spilling.segments import Segments, WholeModel
from lightning_varuna.spilling.shards import ShardedModel, Turn, any_time
from lightning_varuna.spilling.store import SpillStore

__all__ = ["ShardPlan", "plan_shards"]


@dataclass
class ShardPlan:
    """A model cut into shards, ready to be spilled (`ShardedModel.spill_all`, filling parked segments first).

    Attributes:
        model: runs the model shard by shard.
        shards: the segments (between the model's CutPoints) of each shard.
        segment_memory: what each segment was measured to need on the device; one entry for the whole model if it
            fits in one shard (it is then not cut).
        kept_bytes: what stays on the device throughout (boundary activations, buffers, tied parameters).
        parked: the segments of a model built on the meta device, materialized and waiting in the store.
        folder: the spill folder (removed with it), if spilling to disk.
        forward_draws: whether measuring drew from torch's CPU generator or the GPU's (the model's forward, or
            materializing a model built on the meta device).
        budget: the memory budget, in bytes.
    """

    model: ShardedModel
    shards: list[list[int]]
    segment_memory: list[SegmentMemory]
    kept_bytes: int
    parked: ParkedSegments | None
    folder: SpillFolder | None
    forward_draws: bool
    budget: int


def plan_shards(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    device: torch.device,
    memory_budget: int | float | None,
    spill_dir: Path | None,
    prefetch: bool,
    tracing: Callable[[], AbstractContextManager[None]] = nullcontext,
    turn: Turn = any_time,
    whole_stays: bool = True,
    training: bool = True,
    stepped: list[nn.Parameter] | None = None,
) -> ShardPlan:
    """Shards of ``module`` for a budget of ``memory_budget`` on ``device`` (see `resolve_budget`),
    measured on the forward inputs ``args, kwargs``; spilled to ``spill_dir`` (None: host memory). Each trace of the
    forward (now, and for inputs of a new shape) runs inside ``tracing()``, each piece of a shard's work inside
    ``turn(work, shard)`` (`ShardedModel`).

    A model that fits in one shard runs whole, by its own forward: it is not traced, and with ``whole_stays`` it
    stays on the device (it fits the budget: nothing need be spilled). Staying, it has no shard fetched beside it:
    it may take all of the room next to what stays on the device; one that does not stay (a sweep's, its turns
    between other models' shards) gets half of it with ``prefetch``. A model on the meta device is cut, and
    materialized a segment at a time as it is measured, each segment parked in the store before the next: it is
    never whole in memory. Not ``training`` (validate, test, predict alone), a segment holds its parameters alone
    and its forward keeps nothing for a backward. In training, the parameters the optimizer steps (``stepped``;
    None: all) hold a gradient and optimizer state, the others a gradient only where they require one.
    """
    meta = MetaModel(module, device) if MetaModel.needed(module) else None
    random_state = generator_states(device)
    cutpoints = _discover(module, args, kwargs, on_meta=meta is not None)
    for b in module.buffers():
        if not b.is_meta:
            b.data = b.data.to(device)  # buffers stay on the device throughout
    measuring = _Measuring(training, frozenset(map(id, module.parameters() if stepped is None else stepped)))
    folder = _spill_folder(spill_dir, sum(measuring.state_bytes(p) for p in module.parameters()))
    store = SpillStore(device, folder.name if folder is not None else None)
    budget = resolve_budget(memory_budget, device)
    try:
        # A whole model that stays on the device has no next shard to fetch beside it: it may use all the room.
        fetched_beside = prefetch and not whole_stays
        whole = (
            None
            if meta
            else _measure_if_one_shard(module, args, kwargs, cutpoints, device, budget, fetched_beside, measuring)
        )
        if whole is not None:
            segments: Segments | WholeModel = WholeModel(module)
            memory, kept, parked = [whole[0]], whole[1], None
            segment_modules = segments.for_inputs(args, kwargs)[1]
            packing = Packing([[0]], [], [True], 0)  # one shard: nothing to fetch meanwhile
            in_segments = [list(range(len(cutpoints) + 1))]  # one segment module: all the segments
        else:
            segments = Segments(module, cutpoints, device=device, tracing=tracing)
            graph, segment_modules = segments.for_inputs(args, kwargs)
            parked = ParkedSegments(store) if meta else None
            memory, kept = _measure(
                module, segment_modules, graph, args, kwargs, cutpoints, device, meta, parked, measuring
            )
            if meta:
                meta.materialize_rest()
            packing = pack_shards(memory, budget, kept, prefetch, training)
            in_segments = packing.shards
    except BaseException:
        store.close()
        if folder is not None:
            folder.cleanup()
        raise
    forward_draws = states_differ(random_state, generator_states(device))
    stays = whole is not None and whole_stays
    where = None if stays else f"`{folder.name}`" if folder is not None else "host memory"
    _log_plan(packing, in_segments, memory, budget, kept, prefetch, where)
    activations = [sum(memory[s].activation_bytes for s in shard) for shard in packing.shards]
    model = ShardedModel(segments, segment_modules, packing, store, activations, stays=stays, turn=turn)
    return ShardPlan(model, in_segments, memory, kept, parked, folder, forward_draws, budget)


def resolve_budget(memory_budget: int | float | None, device: torch.device) -> int:
    """Bytes for a `memory_budget` of bytes, a share of the device's memory (a float, 0.5 for "50%"), or None:
    what the device has free."""
    if memory_budget is None:
        return _free_bytes(device)
    if isinstance(memory_budget, float):
        return int(memory_budget * _total_bytes(device))
    return memory_budget


def _log_plan(
    packing: Packing,
    in_segments: list[list[int]],
    memory: list[SegmentMemory],
    budget: int,
    kept: int,
    prefetch: bool,
    where: str | None,
) -> None:
    """Say how the model is cut and where it waits (``where``: None, it stays on the device), which shards compute
    their forward again in backward, and which are not fetched while another computes."""
    whole = len(memory) == 1
    if where is None:
        placement = "run whole (not cut); kept on the device (not spilled)."
    elif whole:
        placement = f"run whole (not cut), as one shard that waits in {where} between its turns on the device."
    else:
        placement = f"spilled to {where}."
    groups = [shard[0] if len(shard) == 1 else (shard[0], shard[-1]) for shard in in_segments]
    lines = [
        f"SpillingStrategy: {in_segments[-1][-1] + 1} segment(s) in {len(in_segments)} shard(s) (segments {groups}) "
        f"for a budget of {format_bytes(budget)}; {placement}"
    ]
    recomputed = [k for k, keeps in enumerate(packing.keeps[:-1]) if not keeps]
    if recomputed:
        lines.append(
            f"Shard(s) {recomputed} compute their forward again in backward: the budget has no room to keep their "
            "activations."
        )
    apart = [[k, k + 1] for k, fits in enumerate(packing.overlaps) if not fits]
    if prefetch and apart:
        smallest, with_prefetch, largest = smallest_budgets(memory, kept)
        lines.append(
            f"Shards {', '.join(map(str, apart))} do not fit on the device together, so neither is fetched while "
            f"the other computes (slower; the segment {largest.name} sets this): `memory_budget={with_prefetch}` "
            f"({format_bytes(with_prefetch)}) fetches every shard ahead."
        )
    rank_zero_info(" ".join(lines))


def _discover(module: nn.Module, args: tuple, kwargs: dict, on_meta: bool) -> list[str]:
    """The CutPoints a forward goes through, from a forward on the first two rows of the batch (the measuring
    forward runs the whole batch next); on the whole batch if the model cannot run two rows. It runs where the model
    is (usually host memory: the inputs are copied there from a GPU), or on the meta device if the model is still
    there."""
    if on_meta:
        return discover_cutpoints(module, *_moved((args, kwargs), torch.device("meta")))
    where = next((p.device for p in module.parameters()), torch.device("cpu"))
    try:
        return discover_cutpoints(module, *_moved(first_rows((args, kwargs), 2), where))
    except Exception:  # noqa: BLE001 - e.g. a batch size built into the model: the whole batch says what is wrong
        pass
    return discover_cutpoints(module, *_moved((args, kwargs), where))  # its error alone, not chained to the first


def _moved(inputs: Any, device: torch.device) -> Any:
    return tree_map_only(Tensor, lambda t: t.to(device), inputs)


def _spill_folder(spill_dir: Path | None, needed: int) -> SpillFolder | None:
    """A fresh folder in ``spill_dir`` with ``needed`` bytes free there (None: spill to host memory)."""
    return SpillFolder(spill_dir, needed) if spill_dir is not None else None


def _measure(
    module: nn.Module,
    segment_modules: list[nn.Module],
    graph: PipelineGraph,
    args: tuple,
    kwargs: dict,
    cutpoints: list[str],
    device: torch.device,
    meta: MetaModel | None,
    parked: ParkedSegments | None,
    measuring: _Measuring,
) -> tuple[list[SegmentMemory], int]:
    """Each segment's parameters with their gradients and optimizer state (up to two tensors per parameter, as
    Adam's moments), and the activations its forward keeps for backward, measured on the first batch; and the
    bytes that stay on the device throughout: the activations at CutPoints and their gradients, the buffers,
    and parameters used by more than one segment. Parameters in host memory visit ``device`` to be measured."""
    names = ["the start", *(f"`{name}`" for name in cutpoints), "the end"]
    weights = [*module.parameters(), *module.buffers()]
    uses: dict[nn.Parameter, int] = {}
    for segment in segment_modules:
        for p in segment.parameters():
            uses[p] = uses.get(p, 0) + 1
    leaves = tree_flatten((args, kwargs))[0]
    values: dict[Source, Any] = {}
    sizes: dict[Source, int] = {}
    last_reads = graph.last_reads()
    segments, kept = [], sum(_nbytes(b) for b in module.buffers())
    kept += sum(measuring.state_bytes(p) for p, n in uses.items() if n > 1)
    for s, segment in enumerate(segment_modules):
        inputs = [leaves[src.index] if src.stage is None else values[src] for src in graph.stage_inputs[s]]
        inputs = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, Tensor) else x for x in inputs]
        if meta is not None:
            meta.materialize([*segment.parameters(), *segment.buffers()])
        in_host_memory = [p for p in segment.parameters() if p.device != device]
        for p in in_host_memory:
            p.data = p.data.to(device)
        meter = SavedTensorMeter(exclude=[*weights, *segment.parameters()])
        with meter.measuring(), measuring.grad_mode(), buffers_kept(segment):
            out = segment(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        values.update({Source(s, i): value.detach() for i, value in enumerate(outs)})
        sizes.update({Source(s, i): _nbytes(value) for i, value in enumerate(outs) if isinstance(value, Tensor)})
        if not measuring.training:  # as the run will, forward only: what is read no more goes
            values = {src: value for src, value in values.items() if last_reads.get(src, -1) > s}
        state = sum(measuring.state_bytes(p) for p in segment.parameters() if uses[p] == 1)
        segments.append(SegmentMemory(f"between {names[s]} and {names[s + 1]}", state, meter.peak))
        del out, outs
        for p in in_host_memory:
            p.data = p.data.to("cpu")
        if parked is not None:
            parked.park(s, [p for p in segment.parameters() if uses[p] == 1])
    return segments, kept + measuring.boundary_bytes(sizes, last_reads, len(segment_modules))


def _measure_if_one_shard(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    cutpoints: list[str],
    device: torch.device,
    budget: int,
    fetched_beside: bool,
    measuring: _Measuring,
) -> tuple[SegmentMemory, int] | None:
    """The whole model's memory on the device and the bytes kept throughout, counted as `_measure` counts them for
    one shard of all segments, from a forward on the first batch; None if they do not fit in one shard (half the
    room if another shard is ``fetched_beside`` it; the forward is skipped when the parameters alone do not fit,
    and a forward that runs out of device memory does not fit)."""
    params = list(module.parameters())
    state = sum(measuring.state_bytes(p) for p in params)
    buffer_bytes = sum(_nbytes(b) for b in module.buffers())
    if state >= shard_share(budget, buffer_bytes, fetched_beside):
        return None
    in_host_memory = [p for p in params if p.device != device]
    for p in in_host_memory:
        p.data = p.data.to(device)
    at_cutpoints: list[int] = []
    meter = SavedTensorMeter(exclude=[*params, *module.buffers()])
    try:
        with (
            meter.measuring(),
            measuring.grad_mode(),
            buffers_kept(module),
            observe_cutpoints(
                module, batch_size_of((args, kwargs)), lambda x: at_cutpoints.append(_nbytes(x)), cutpoints
            ),
        ):
            module(*args, **kwargs)
    except torch.OutOfMemoryError:
        return None
    finally:
        for p in in_host_memory:
            p.data = p.data.to("cpu")
    sizes = {Source(s, 0): size for s, size in enumerate(at_cutpoints)}  # as when cut, each read by the next
    read_next = {src: s + 1 for s, src in enumerate(sizes)}
    kept = buffer_bytes + measuring.boundary_bytes(sizes, read_next, len(sizes) + 1)
    if state + meter.peak > shard_share(budget, kept, fetched_beside):
        return None
    return SegmentMemory("the whole model", state, meter.peak), kept


@dataclass(frozen=True)
class _Measuring:
    """What a run holds on the device: in training, a parameter the optimizer steps (``stepped``, by id) with its
    gradient and optimizer state (up to two tensors, as Adam's moments), another one with its gradient if it
    requires one, each activation at a CutPoint with its gradient, and what a forward keeps for its backward;
    forward only, the parameters and activations alone."""

    training: bool
    stepped: frozenset[int]

    def state_bytes(self, param: nn.Parameter) -> int:
        stepped = id(param) in self.stepped
        copies = 1 + (stepped or param.requires_grad) + 2 * stepped if self.training else 1
        return copies * _nbytes(param)

    def boundary_bytes(self, sizes: dict[Source, int], last_reads: dict[Source, int], segments: int) -> int:
        """The bytes of the values the ``segments`` make (``sizes``, by the segment that makes them) held on the
        device: in training, every one but the last segment's, each with its gradient, kept for the backward;
        forward only, the most held at once, while a segment runs (its inputs, its outputs and the values that pass
        it by)."""
        if self.training:
            return 2 * sum(size for src, size in sizes.items() if src.stage is not None and src.stage < segments - 1)
        made = {src: src.stage for src in sizes if src.stage is not None}
        return max(
            (
                sum(sizes[src] for src, m in made.items() if m == s or m < s <= last_reads.get(src, -1))
                for s in set(made.values())
            ),
            default=0,
        )

    def grad_mode(self) -> AbstractContextManager[None]:
        return torch.enable_grad() if self.training else torch.no_grad()


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_bytes()


def available_host_bytes() -> int:
    """The host memory that new allocations can take without swapping (Linux's MemAvailable)."""
    return _meminfo("MemAvailable")


def _total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return _meminfo("MemTotal")


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info[field].split()[0]) * 1024
