"""A model whose shards take turns on the device: forward shard by shard keeping only the activations at shard
boundaries (and, where the budget has room, those a shard's backward needs), backward in reverse (recomputing the
forward of each shard that did not keep its activations), optimizer step shard by shard.

A shard is a run of consecutive segments of the model cut at all its CutPoints (`split_into_all_stages`); while a
shard is spilled its parameters, gradients and optimizer state are in the `SpillStore`, and its parameters hold no
elements (so that a stray use fails loudly).
Parameters used by more than one shard (tied weights) and all buffers stay on the device.

A step may call the model more than once (a consistency loss on two inputs, a metric under `torch.no_grad`): each
call with gradients is a `_Call`, and the backward runs each shard's part of every call before the shard leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_unflatten

from lightning_varuna._torch_private import foreach_norm
from lightning_varuna.partition.packing import Packing
from lightning_varuna.partition.split import PipelineGraph, Source
from lightning_varuna.pipeline.replay import BufferState, DtypeState, RandomState, generator_states, states_differ
from lightning_varuna.spilling.outside_calls import refuse_calls_while_spilled
from lightning_varuna.spilling.saved_parameters import parameters_saved_by_reference
from lightning_varuna.spilling.segments import Segments, WholeModel
from lightning_varuna.spilling.store import SpillStore

__all__ = ["Shard", "ShardedModel", "Turn", "any_time"]

# ``turn(work, shard)``: a context in which ``shard``'s ``work`` ("forward", "backward" or "step") runs; it yields
# whether it holds torch's global generator.
Turn = Callable[[str, int], AbstractContextManager[bool]]


def any_time(work: str, shard: int) -> AbstractContextManager[bool]:
    """The turn of a model alone on its device: at once, holding torch's global generator."""
    return nullcontext(True)


@dataclass
class Shard:
    """Consecutive segments that visit the device together, and the parameters only they use."""

    index: int
    segments: list[int]
    params: list[nn.Parameter]
    grad_norms: dict[nn.Parameter, Tensor] = field(default_factory=dict, repr=False)  # after its last backward

    def key(self, part: str) -> str:
        return f"shard{self.index}.{part}"


@dataclass
class _ShardRun:
    """What one shard's forward in a call leaves for its backward: the outputs it sends on, with their autograd
    graph (``kept``: its activations were kept), or what computing it again needs."""

    kept: dict[Source, Tensor] | None = None
    random_state: RandomState | None = None  # before its forward (dropout on recompute)
    buffers: BufferState | None = None  # as its forward found them
    random_after: list[Tensor] | None = None  # the generators' states after its forward


class _Call:
    """One call of the model with gradients, from its forward to its backward: the values at shard boundaries (the
    inputs, and each shard's outputs read by later shards or returned) and what each shard's forward left."""

    def __init__(
        self,
        graph: PipelineGraph,
        modules: list[nn.Module],
        inputs: list[Any],
        shard_of: dict[int, int],
        dtypes: DtypeState,
    ) -> None:
        self.graph, self.modules, self.dtypes = graph, modules, dtypes  # the forward's dtypes, replayed by recomputes
        self.boundaries: dict[Source, Any] = {Source(None, i): leaf for i, leaf in enumerate(inputs)}
        self.last_read = graph.last_reads()  # the last segment that reads a value
        last_shard = max(shard_of.values())
        self.last_consumer = {  # the last shard that reads it (past the last: an output)
            src: last_shard + 1 if s == graph.num_stages else shard_of[s] for src, s in self.last_read.items()
        }
        self.runs: dict[int, _ShardRun] = {}
        # The leaves whose ``.grad`` backward reads, of the outputs a shard sends on: the boundaries hold a view of
        # each, which autocast casts anew at each use, as it does the value on one device (it caches casts of leaves).
        self.leaves: dict[Source, Tensor] = {}


class ShardedModel:
    """Run a model's segments shard by shard on ``store.device``.

    Args:
        segments: the model cut at every CutPoint (traced per input shape and mode), or whole.
        segment_modules: the segment modules of one trace (all traces bind the same parameters).
        packing: the shards (segment indices, in order), which neighbours fit on the device together (one fetched
            while the other computes), and which keep their activations for backward.
        store: where spilled shards wait.
        activation_bytes: what each shard's forward keeps for its backward, as measured.
        stays: keep the model on the device, never spilled (a whole model, `WholeModel`, that fits its budget).
        turn: each piece of a shard's work (its forward, its backward, its optimizer step) runs inside
            ``turn(work, shard)``: a sweep of models (`MultiModelTrainer`) waits there for a device. The turn yields
            whether it holds torch's global generator: only then is a forward's random state kept to be replayed by
            its recompute (a turn that does not hold it runs a shard found to draw no random numbers).
    """

    def __init__(
        self,
        segments: Segments | WholeModel,
        segment_modules: list[nn.Module],
        packing: Packing,
        store: SpillStore,
        activation_bytes: list[int],
        stays: bool = False,
        turn: Turn = any_time,
    ) -> None:
        if stays and not isinstance(segments, WholeModel):
            raise ValueError("Only a model that runs whole (one shard, uncut) stays on the device.")
        self.segments, self.store, self.packing = segments, store, packing
        self.stays, self._turn = stays, turn
        self._activation_bytes = activation_bytes
        self._shard_of = {s: k for k, shard in enumerate(packing.shards) for s in shard}
        # A shard spills the parameters only its segments use; the others (tied weights) stay on the device.
        owners: dict[nn.Parameter, set[int]] = {}
        for s, module in enumerate(segment_modules):
            for p in module.parameters():
                owners.setdefault(p, set()).add(self._shard_of[s])
        self.shards = [
            Shard(k, segment_indices, [p for p, ks in owners.items() if ks == {k}])
            for k, segment_indices in enumerate(packing.shards)
        ]
        self.resident_params = [p for p in segments.module.parameters() if len(owners.get(p, ())) != 1]
        self._loaded: dict[int, set[str]] = {k: {"params", "grads", "state"} for k in range(len(self.shards))}
        self._has_grad: set[nn.Parameter] = set()  # spilled parameters whose gradients are in the store
        self._state_slots: dict[int, list[tuple[nn.Parameter, str]]] = {}  # shard -> its spilled optimizer state
        self._optimizer: torch.optim.Optimizer | None = None
        self._calls: list[_Call] = []  # the calls with gradients since the last backward
        self._kept_activations = 0  # of those calls' shards that keep them (beyond the first call's last shard)
        self._allow_outside_calls: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------------------------------ residency
    def spill_all(
        self, optimizer: torch.optim.Optimizer | None = None, fill: Callable[[list[int]], None] | None = None
    ) -> None:
        """Move every shard to the store (at setup), or to the device if shards stay there; ``optimizer`` is the one
        whose state moves with them. ``fill(segments)``, if given, first gives the parameters of a shard's segments
        their values (a model materialized a segment at a time). Gradients left on the parameters (by a fit that
        failed after its backward) are dropped, as Lightning zeroes them before the first step."""
        self._optimizer = optimizer
        for p in self.resident_params:
            p.data = p.data.to(self.store.device)
        for shard in self.shards:
            if fill is not None:
                fill(shard.segments)
            for p in shard.params:
                p.grad = None
            if self.stays:
                for p in shard.params:
                    p.data = p.data.to(self.store.device)
            self._evict(shard, write=("params", "grads", "state"))
        if not self.stays:
            self._allow_outside_calls()
            spilled = [p for shard in self.shards for p in shard.params]
            self._allow_outside_calls = refuse_calls_while_spilled(self.segments.module, spilled)

    def _bring(self, shard: Shard, parts: tuple[str, ...]) -> None:
        """Put ``shard``'s parameters and the other ``parts`` ("grads", "state") that are spilled on the device."""
        loaded = self._loaded.get(shard.index)
        if loaded is None:
            for p, t in zip(shard.params, self.store.get(shard.key("params"))):
                p.data = t
            loaded = self._loaded[shard.index] = {"params"}
        if "grads" in parts and "grads" not in loaded:
            if shard.key("grads") in self.store:
                grads = iter(self.store.get(shard.key("grads")))
                for p in shard.params:
                    if p in self._has_grad:
                        p.grad = next(grads)
            loaded.add("grads")
        if "state" in parts and "state" not in loaded:
            if shard.key("state") in self.store and self._optimizer is not None:
                for (p, name), t in zip(self._state_slots[shard.index], self.store.get(shard.key("state"))):
                    self._optimizer.state[p][name] = t
            loaded.add("state")

    @contextmanager
    def _fetching(self, current: int, index: int, parts: tuple[str, ...]) -> Iterator[None]:
        """Fetch shard ``index`` (if there is one) while the block computes shard ``current``. On the CPU the fetch (a
        disk read) starts first; on a GPU, where the block only issues its work, it starts after, so that it can wait
        for the shard before the current one to leave the device (see `SpillStore`) while the GPU computes."""
        if self.store.device.type != "cuda":
            self._prefetch(current, index, parts)
        yield
        if self.store.device.type == "cuda":
            self._prefetch(current, index, parts)

    def _prefetch(self, current: int, index: int, parts: tuple[str, ...]) -> None:
        """Start fetching shard ``index`` (if there is one, and it fits on the device beside shard ``current``)."""
        if not 0 <= index < len(self.shards) or index in self._loaded or not self.packing.overlaps[min(current, index)]:
            return
        shard = self.shards[index]
        for part in ("params", *parts):
            self.store.prefetch(shard.key(part))

    def _evict(self, shard: Shard, write: tuple[str, ...] = ()) -> None:
        """Spill ``shard``: store the ``write`` parts that are on the device (the others are unchanged since they were
        stored); a shard that stays on the device stays."""
        loaded = self._loaded.get(shard.index)
        if loaded is None or self.stays:
            return
        write = tuple(part for part in write if part in loaded)
        if "params" in write:
            self.store.put(shard.key("params"), [p.data for p in shard.params])
        if "grads" in write:
            grads = [p for p in shard.params if p.grad is not None]
            self._has_grad.difference_update(shard.params)
            self._has_grad.update(grads)
            if grads:
                self.store.put(shard.key("grads"), [p.grad for p in grads])  # type: ignore[misc]
            else:
                self.store.discard(shard.key("grads"))
        if "state" in write and self._optimizer is not None:
            slots = [
                (p, name)
                for p in shard.params
                for name, value in sorted(self._optimizer.state.get(p, {}).items())
                if _spilled_with_shard(value)
            ]
            self._state_slots[shard.index] = slots
            self.store.put(shard.key("state"), [self._optimizer.state[p][name] for p, name in slots])
        if self._optimizer is not None:
            for p, name in self._state_slots.get(shard.index, []):
                self._optimizer.state[p].pop(name, None)
        for p in shard.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
        del self._loaded[shard.index]

    # -------------------------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output, computed shard by shard. With gradients enabled, the last shard stays on the device
        with its autograd graph; the outputs of the others are leaves whose ``.grad`` `backward` reads. A whole
        model that stays on the device runs its own forward in a turn: nothing crosses a shard's edge to keep."""
        if self.stays and isinstance(self.segments, WholeModel):  # (only a whole model stays: see __init__)
            with self._turn("forward", 0):
                return self.segments.run(args, kwargs)
        training = torch.is_grad_enabled()
        graph, modules = self.segments.for_inputs(args, kwargs)
        dtypes = DtypeState.current(self.store.device.type)
        call = _Call(graph, modules, tree_leaves((args, kwargs)), self._shard_of, dtypes)
        if training and self._calls:
            _refuse_inputs_from_earlier_calls(args, kwargs)
        for shard in self.shards:
            with self._turn("forward", shard.index) as holds_generator:
                keeps = training and self._keeps(shard)
                self._forward_shard(call, shard, training, keeps, replayable=training and holds_generator)
        if training:
            self._calls.append(call)
        outputs = [call.boundaries[src] for src in graph.output_sources]
        return tree_unflatten(outputs, graph.output_spec)

    def _keeps(self, shard: Shard) -> bool:
        """Whether ``shard``'s forward in this call keeps its activations for backward: planned so where the budget
        has room, and while the calls of this step so far leave that room (a step may call the model twice)."""
        last = shard.index == len(self.shards) - 1
        if last and not self._calls:
            return True
        if not (last or self.packing.keeps[shard.index]):
            return False
        more = self._activation_bytes[shard.index]
        # The first call's last shard holds its activations (counted in its own room) while later calls run.
        held = self._kept_activations + (self._activation_bytes[-1] if self._calls else 0)
        if held + more > self.packing.kept_activation_bytes:
            return False
        self._kept_activations += more
        return True

    def _forward_shard(self, call: _Call, shard: Shard, training: bool, keeps: bool, replayable: bool) -> None:
        last = shard.index == len(self.shards) - 1
        stays_for_loss = keeps and last  # its outputs go to the loss with their graph
        for other in [k for k in self._loaded if k != shard.index]:
            self._evict(self.shards[other], write=("grads",))  # the last shard of an earlier call of the step
        self._bring(shard, ("grads",) if stays_for_loss else ())
        run = _ShardRun(kept={} if keeps else None)
        if training and not keeps:
            run.random_state = RandomState(self.store.device) if replayable else None
            run.buffers = BufferState(call.modules[s] for s in shard.segments)
        # In training, with autograd on even where the graph is then dropped: a value crossing to the next shard
        # needs a gradient only where it would in the whole model, and kernels choose by it (attention takes
        # another kernel for a mask that needs a gradient, which rounds differently).
        saved = parameters_saved_by_reference(shard.params) if keeps else nullcontext()
        with self._fetching(shard.index, shard.index + 1, ()), saved:
            produced = self._run(call, shard, training)
        if run.random_state is not None:
            run.random_after = generator_states(self.store.device)
        for src, value in produced.items():
            if call.last_consumer.get(src, -1) > shard.index:
                if training and not stays_for_loss and isinstance(value, Tensor) and value.requires_grad:
                    if run.kept is not None:
                        run.kept[src] = value
                    leaf = call.leaves[src] = value.detach().requires_grad_(True)
                    value = leaf.view_as(leaf)
                call.boundaries[src] = value
        if training:
            call.runs[shard.index] = run
        if not stays_for_loss:
            self._evict(shard)

    def _run(self, call: _Call, shard: Shard, training: bool) -> dict[Source, Any]:
        """Run the segments of ``shard`` on the call's boundary values; return every value they produce. Forward
        only, a value is let go once its last reader has run: no backward will need it."""
        values: dict[Source, Any] = {}
        for s in shard.segments:
            inputs = call.graph.stage_inputs[s]
            args = [values[src] if src in values else call.boundaries[src] for src in inputs]
            out = call.modules[s](*args)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            made = [Source(s, i) for i in range(len(outs))]
            values.update(zip(made, outs))
            del args, out, outs
            if not training:
                for src in [*inputs, *made]:
                    if call.last_read.get(src, -1) <= s:
                        values.pop(src, None)
                        call.boundaries.pop(src, None)
        return values

    def discard_calls(self) -> None:
        """Forget the calls of a step that ran no backward (its `training_step` returned None)."""
        self._calls, self._kept_activations = [], 0

    # ------------------------------------------------------------------------------------------- backward
    @contextmanager
    def backward(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        unscale: Callable[[list[nn.Parameter]], None] | None = None,
    ) -> Iterator[None]:
        """The step's backward, shard by shard: the block backpropagates the loss through the last shard (on the
        device, with the gradients of earlier batches); then each shard, in reverse, is backpropagated for every call
        of the step (from the activations it kept, or computed again); each shard's gradients (summed into those of
        earlier batches) are spilled with it.

        With ``optimizer``, each shard steps as soon as its gradients are complete, while it is on the device
        (nothing needs the gradients of all shards first: no clipping by their norm), and only its parameters and
        optimizer state are spilled: the separate optimizer pass over all shards is saved. ``unscale(params)`` (fp16
        loss scaling, before a step) gets each spilled shard's complete gradients before they are spilled.
        """
        calls = self._calls
        self.discard_calls()
        self._optimizer = optimizer or self._optimizer
        parts = ("grads", "state") if optimizer is not None else ("grads",)
        for shard in reversed(self.shards):
            with self._turn("backward", shard.index) as holds_generator:
                self._bring(shard, parts)
                with self._fetching(shard.index, shard.index - 1, parts):
                    if shard.index == len(self.shards) - 1:
                        yield  # the loss's backward
                    for call in reversed(calls):
                        self._backward_through(call, shard, replay=holds_generator)
                if optimizer is not None:
                    self._step_shard(optimizer, shard.params)
                    self._evict(shard, write=("params", "grads", "state"))
                else:
                    if unscale is not None and not self.stays:
                        unscale(shard.params)
                    shard.grad_norms = _grad_norms(shard.params)
                    self._evict(shard, write=("grads",))
        if optimizer is not None and self.resident_params:
            with self._turn("step", len(self.shards)):
                self._step_shard(optimizer, self.resident_params, keep_grads=True)

    def spilled_grad_norms(self) -> dict[nn.Parameter, Tensor]:
        """The 2-norm of each spilled parameter's gradient after the last backward (a spilled parameter holds no
        ``.grad``); none while the model stays on the device."""
        return {} if self.stays else {p: norm for shard in self.shards for p, norm in shard.grad_norms.items()}

    def _backward_through(self, call: _Call, shard: Shard, replay: bool) -> None:
        """Backpropagate the gradients of ``shard``'s outputs in ``call`` through it: from the activations its forward
        kept, or from its forward run again as it first ran (random numbers, if ``replay``; autocast and default dtype;
        the buffers as it found them, and those it updated left alone)."""
        run = call.runs.get(shard.index)
        made = set(shard.segments)
        grads = {src: leaf.grad for src, leaf in call.leaves.items() if src.stage in made and leaf.grad is not None}
        if run is None or not grads:
            return  # no gradient reaches this shard's outputs in this call (or they went to the loss directly)
        if run.kept is not None:
            produced = run.kept
        else:
            random_state = run.random_state if replay else None
            with (
                random_state.replayed() if random_state is not None else nullcontext(),
                run.buffers.replayed() if run.buffers is not None else nullcontext(),
                torch.enable_grad(),
                call.dtypes.replayed(),
            ):
                produced = self._run(call, shard, training=True)
                if random_state is not None:
                    _check_replayed(shard, random_state, run.random_after)
        outputs = [src for src in grads if src in produced and produced[src].requires_grad]
        if outputs:
            torch.autograd.backward([produced[src] for src in outputs], [grads[src] for src in outputs])

    # ------------------------------------------------------------------------------------------ optimizer
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        clip: Callable[[list[nn.Parameter], Tensor], None] | None = None,
    ) -> None:
        """``optimizer.step()`` shard by shard, each shard's parameters, gradients and state on the device together.

        ``clip(params, total_norm)`` (gradient clipping) gets each shard's parameters and the norm over all.
        """
        self._optimizer = optimizer
        total = None
        if clip is not None:
            # The spilled gradients' norms were taken in their backward; those on the device may have changed since
            # (unscaled by fp16's grad scaler).
            if self.stays:
                norms = _grad_norms(self.resident_params + [p for s in self.shards for p in s.params])
            else:
                norms = {p: n for s in self.shards for p, n in s.grad_norms.items()}
                norms.update(_grad_norms(self.resident_params))
            # Combined in the optimizer's order, as `clip_grad_norm_` combines them for the model whole.
            ordered = [norms[p] for group in optimizer.param_groups for p in group["params"] if p in norms]
            total = torch.linalg.vector_norm(torch.stack(ordered)) if ordered else torch.zeros(())
        for shard in self.shards:
            with self._turn("step", shard.index):
                self._bring(shard, ("grads", "state"))
                with self._fetching(shard.index, shard.index + 1, ("grads", "state")):
                    if clip is not None and total is not None:
                        clip(shard.params, total)
                    self._step_shard(optimizer, shard.params)
                self._evict(shard, write=("params", "grads", "state"))
        if self.resident_params:
            with self._turn("step", len(self.shards)):
                if clip is not None and total is not None:
                    clip(self.resident_params, total)
                self._step_shard(optimizer, self.resident_params, keep_grads=True)

    def drop_gradients(self) -> None:
        """Forget the spilled shards' gradients: a step that did not run (an fp16 overflow) leaves them, which
        Lightning's ``zero_grad`` before the next backward cannot reach."""
        for shard in self.shards:
            self.store.discard(shard.key("grads"))
        self._has_grad.clear()

    def _step_shard(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], keep_grads: bool = False
    ) -> None:
        """Step ``optimizer`` on ``params`` alone; their gradients are consumed (Lightning zeroes them before the
        next backward), except those of parameters that stay on the device, which Lightning zeroes itself."""
        with _only(optimizer, set(params)):
            optimizer.step()
        if not keep_grads:
            for p in params:
                p.grad = None

    def visit(self, parts: tuple[str, ...] = (), write: tuple[str, ...] = ()) -> Iterator[list[nn.Parameter]]:
        """Each shard's parameters in turn, on the device with its other ``parts`` ("grads", "state"), the next one
        fetched meanwhile; each spilled again after its turn, storing the ``write`` parts (changed in its turn);
        last the parameters that stay on the device. To read or write the whole model a shard at a time."""
        for shard in self.shards:
            self._bring(shard, parts)
            self._prefetch(shard.index, shard.index + 1, parts)
            try:
                yield shard.params
            finally:
                self._evict(shard, write=write)
        yield self.resident_params

    def restore(self, device: torch.device) -> None:
        """Put every shard's parameters, gradients and optimizer state back into the model for good (after
        training), a shard at a time; drop the store. A shard on the device goes to ``device``; a spilled one takes
        the host memory it waits in (the disk tier's files mapped into memory: read only where touched, and counted
        as the files' pages, not as the process's own memory)."""
        for shard in self.shards:
            if shard.index in self._loaded:
                self._restore_loaded(shard, device)
                continue
            for p, t in zip(shard.params, self.store.in_host_memory(shard.key("params"))):
                p.data = t
            if shard.key("grads") in self.store:
                grads = iter(self.store.in_host_memory(shard.key("grads")))
                for p in shard.params:
                    if p in self._has_grad:
                        p.grad = next(grads)
            if shard.key("state") in self.store and self._optimizer is not None:
                state = self.store.in_host_memory(shard.key("state"))
                for (p, name), t in zip(self._state_slots[shard.index], state):
                    self._optimizer.state[p][name] = t
        self._allow_outside_calls()
        self.store.close()

    def _restore_loaded(self, shard: Shard, device: torch.device) -> None:
        self._bring(shard, ("grads", "state"))
        for p in shard.params:
            p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
            if self._optimizer is not None:
                state = self._optimizer.state.get(p, {})
                state.update({k: v.to(device) for k, v in state.items() if _spilled_with_shard(v)})


def _refuse_inputs_from_earlier_calls(args: tuple, kwargs: dict) -> None:
    """A second call of the model in a step may not take a value that needs a gradient through the model (an output
    of an earlier call, or computed from one): each call is backpropagated shard by shard on its own."""
    if any(isinstance(x, Tensor) and x.requires_grad and x.grad_fn is not None for x in tree_leaves((args, kwargs))):
        raise ValueError(
            "This step calls `self(...)` again on a tensor that needs a gradient through what was computed before in "
            "the step (an output of an earlier `self(...)`, or computed from one, as in `self(self(x))`). "
            "SpillingStrategy backpropagates each call of the model shard by shard on its own, so that gradient "
            "cannot flow back into the earlier call. Pass the input detached (`self(out.detach())`) if no gradient "
            "should flow back through it, or compute the repeated part inside `forward`, where it is one call."
        )


def _check_replayed(shard: Shard, random_state: RandomState, random_after: list[Tensor] | None) -> None:
    """A recompute that drew random numbers must end where its forward ended, or its dropout masks differ."""
    replayed = generator_states(random_state.device)
    drew = states_differ(random_state.states, replayed)
    if drew and states_differ(replayed, random_after):  # type: ignore[arg-type]
        raise RuntimeError(
            f"Shard {shard.index}'s forward could not be replayed for its backward: its random numbers (dropout) "
            "differ from the first run's, because something else drew from torch's global generator while that "
            "shard ran (in a sweep: another model's `training_step`, or a sampler without its own `generator`). "
            "Draw such random numbers from a `torch.Generator` of your own."
        )


@contextmanager
def _only(optimizer: torch.optim.Optimizer, params: set[nn.Parameter]) -> Iterator[None]:
    """The optimizer sees only ``params`` in its groups for the block (its hyper-parameters unchanged)."""
    groups = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p in params]
    try:
        yield
    finally:
        for group, original in zip(optimizer.param_groups, groups):
            group["params"] = original


def _spilled_with_shard(state_value: object) -> bool:
    """Whether an optimizer state value moves with its shard (a tensor; a scalar such as the step count stays)."""
    return isinstance(state_value, Tensor) and state_value.numel() > 1


def _grad_norms(params: list[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
    """Each gradient's 2-norm, taken as `torch.nn.utils.get_total_norm` takes it before combining them."""
    with_grads = [p for p in params if p.grad is not None]
    if not with_grads:
        return {}
    return dict(zip(with_grads, foreach_norm([p.grad for p in with_grads])))  # type: ignore[misc]
