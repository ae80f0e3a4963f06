"""A model whose shards take turns on the device: forward shard by shard keeping only the activations at shard
boundaries, backward in reverse recomputing each shard's forward, optimizer step shard by shard.

A shard is a run of consecutive segments of the model cut at all its CutPoints (`split_into_all_stages`); while a
shard is spilled its parameters, gradients and optimizer state are in the `SpillStore`, and its parameters hold no
elements (so that a stray use fails loudly).
Parameters used by more than one shard (tied weights) and all buffers stay on the device.
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
from lightning_varuna.partition.split import PipelineGraph, Source
from lightning_varuna.pipeline.replay import BufferState, DtypeState, RandomState, generator_states, states_differ
from lightning_varuna.spilling.segments import Segments, WholeModel
from lightning_varuna.spilling.store import SpillStore

__all__ = ["Shard", "ShardedModel"]


@dataclass
class Shard:
    """Consecutive segments that visit the device together, and the parameters only they use."""

    index: int
    segments: list[int]
    params: list[nn.Parameter]
    grad_norms: dict[nn.Parameter, Tensor] = field(default_factory=dict, repr=False)  # after its last backward
    random_state: RandomState | None = field(default=None, repr=False)  # before its forward (dropout on recompute)
    buffers: BufferState | None = field(default=None, repr=False)  # as its forward found them (for its recompute)
    random_after: list[Tensor] | None = field(default=None, repr=False)  # the generators' states after its forward

    def key(self, part: str) -> str:
        return f"shard{self.index}.{part}"


class ShardedModel:
    """Run a model's segments shard by shard on ``store.device``.

    Args:
        segments: the model cut at every CutPoint (traced per input shape and mode), or whole.
        segment_modules: the segment modules of one trace (all traces bind the same parameters).
        shards: the segment indices of each shard, in order.
        store: where spilled shards wait.
        prefetch: fetch the next shard while the current one computes.
        stays: keep every shard on the device, never spilled (a model that fits its budget in one shard).

    Each piece of a shard's work (its forward, its backward, its optimizer step) runs inside ``turn(work, shard)``,
    ``work`` being "forward", "backward" or "step": a sweep of models (`MultiModelTrainer`) waits there for a device.
    The turn yields whether it holds torch's global generator: only then is a forward's random state kept to be
    replayed by its recompute (a turn that does not hold it runs a shard found to draw no random numbers).
    """

    def __init__(
        self,
        segments: Segments | WholeModel,
        segment_modules: list[nn.Module],
        shards: list[list[int]],
        store: SpillStore,
        prefetch: bool = True,
        stays: bool = False,
    ) -> None:
        self.segments, self.store = segments, store
        self.prefetch_next, self.stays = prefetch, stays
        self._shard_of = {s: k for k, shard in enumerate(shards) for s in shard}
        # A shard spills the parameters only its segments use; the others (tied weights) stay on the device.
        owners: dict[nn.Parameter, set[int]] = {}
        for s, module in enumerate(segment_modules):
            for p in module.parameters():
                owners.setdefault(p, set()).add(self._shard_of[s])
        self.shards = [
            Shard(k, segment_indices, [p for p, ks in owners.items() if ks == {k}])
            for k, segment_indices in enumerate(shards)
        ]
        self.resident_params = [p for p in segments.module.parameters() if len(owners.get(p, ())) != 1]
        self._loaded: dict[int, set[str]] = {k: {"params", "grads", "state"} for k in range(len(self.shards))}
        self._has_grad: set[nn.Parameter] = set()  # spilled parameters whose gradients are in the store
        self._state_slots: dict[int, list[tuple[nn.Parameter, str]]] = {}  # shard -> its spilled optimizer state
        self._optimizer: torch.optim.Optimizer | None = None
        self._graph: PipelineGraph | None = None
        self._modules: list[nn.Module] = []
        self._boundaries: dict[Source, Any] = {}
        self._last_read: dict[Source, int] = {}  # the last segment that reads a value
        self._last_consumer: dict[Source, int] = {}  # the last shard that reads it
        self._dtypes = DtypeState.current("cpu")  # the forward's, replayed by recomputes
        self.turn: Callable[[str, int], AbstractContextManager[bool]] = lambda work, shard: nullcontext(True)

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
    def _fetching(self, index: int, parts: tuple[str, ...]) -> Iterator[None]:
        """Fetch shard ``index`` (if there is one) while the block computes the current one. On the CPU the fetch (a
        disk read) starts first; on a GPU, where the block only issues its work, it starts after, so that it can wait
        for the shard before the current one to leave the device (see `SpillStore`) while the GPU computes."""
        if self.store.device.type != "cuda":
            self._prefetch(index, parts)
        yield
        if self.store.device.type == "cuda":
            self._prefetch(index, parts)

    def _prefetch(self, index: int, parts: tuple[str, ...]) -> None:
        """Start fetching shard ``index`` (if there is one)."""
        if not 0 <= index < len(self.shards) or not self.prefetch_next or index in self._loaded:
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
        with its autograd graph; the outputs of the others are leaves whose ``.grad`` `backward` reads."""
        training = torch.is_grad_enabled()
        self._use_trace(args, kwargs)
        self._dtypes = DtypeState.current(self.store.device.type)
        inputs = tree_leaves((args, kwargs))
        self._boundaries = {Source(None, i): leaf for i, leaf in enumerate(inputs)}
        last = len(self.shards) - 1
        for shard in self.shards:
            with self.turn("forward", shard.index) as holds_generator:
                self._forward_shard(shard, training and holds_generator, training, training and shard.index == last)
        assert self._graph is not None
        outputs = [self._boundaries[src] for src in self._graph.output_sources]
        return tree_unflatten(outputs, self._graph.output_spec)

    def _forward_shard(self, shard: Shard, replayable: bool, training: bool, with_graph: bool) -> None:
        self._bring(shard, ("grads",) if with_graph else ())
        shard.random_state = RandomState(self.store.device) if replayable else None
        recomputed = training and not with_graph
        shard.buffers = BufferState(self._modules[s] for s in shard.segments) if recomputed else None
        # In training, with autograd on even where the graph is then dropped: a value crossing to the next shard
        # needs a gradient only where it would in the whole model, and kernels choose by it (attention takes
        # another kernel for a mask that needs a gradient, which rounds differently).
        with self._fetching(shard.index + 1, ()):
            produced = self._run(shard, training)
        if replayable:
            shard.random_after = generator_states(self.store.device)
        for src, value in produced.items():
            if self._last_consumer.get(src, -1) > shard.index:
                if training and not with_graph and isinstance(value, Tensor) and value.requires_grad:
                    value = value.detach().requires_grad_(True)
                self._boundaries[src] = value
        if not with_graph:
            self._evict(shard)

    def _use_trace(self, args: tuple, kwargs: dict) -> None:
        self._graph, self._modules = self.segments.for_inputs(args, kwargs)
        self._last_read = self._graph.last_reads()
        self._last_consumer = {
            src: len(self.shards) if s == self._graph.num_stages else self._shard_of[s]
            for src, s in self._last_read.items()
        }

    def _run(self, shard: Shard, training: bool) -> dict[Source, Any]:
        """Run the segments of ``shard`` on the kept boundary values; return every value they produce. Forward
        only, a value is let go once its last reader has run: no backward will need it."""
        assert self._graph is not None
        values: dict[Source, Any] = {}
        for s in shard.segments:
            inputs = self._graph.stage_inputs[s]
            args = [values[src] if src in values else self._boundaries[src] for src in inputs]
            out = self._modules[s](*args)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            made = [Source(s, i) for i in range(len(outs))]
            values.update(zip(made, outs))
            del args, out, outs
            if not training:
                for src in [*inputs, *made]:
                    if self._last_read.get(src, -1) <= s:
                        values.pop(src, None)
                        self._boundaries.pop(src, None)
        return values

    # ------------------------------------------------------------------------------------------- backward
    def backward(
        self,
        loss: Tensor,
        backward: Callable[[Tensor], None],
        optimizer: torch.optim.Optimizer | None = None,
        unscale: Callable[[list[nn.Parameter]], None] | None = None,
    ) -> None:
        """``backward(loss)`` through the last shard, then each earlier shard recomputed and backpropagated, in
        reverse; each shard's gradients (summed into those of earlier batches) are spilled with it.

        With ``optimizer``, each shard steps as soon as its gradients are complete, while it is on the device
        (nothing needs the gradients of all shards first: no clipping by their norm), and only its parameters and
        optimizer state are spilled: the separate optimizer pass over all shards is saved. ``unscale(params)`` (fp16
        loss scaling, before a step) gets each spilled shard's complete gradients before they are spilled.
        """
        self._optimizer = optimizer or self._optimizer
        parts = ("grads", "state") if optimizer is not None else ("grads",)
        for shard in reversed(self.shards):
            with self.turn("backward", shard.index) as holds_generator:
                self._bring(shard, parts)
                with self._fetching(shard.index - 1, parts):
                    if shard.index == len(self.shards) - 1:
                        backward(loss)
                    else:
                        self._backward_through(shard, replay=holds_generator)
                if optimizer is not None:
                    self._step_shard(optimizer, shard.params)
                    self._evict(shard, write=("params", "grads", "state"))
                else:
                    if unscale is not None and not self.stays:
                        unscale(shard.params)
                    shard.grad_norms = _grad_norms(shard.params)
                    self._evict(shard, write=("grads",))
        if optimizer is not None and self.resident_params:
            with self.turn("step", len(self.shards)):
                self._step_shard(optimizer, self.resident_params, keep_grads=True)
        self._boundaries = {}

    def _backward_through(self, shard: Shard, replay: bool) -> None:
        """Run ``shard``'s forward again as it first ran (random numbers, if ``replay``; autocast and default dtype;
        the buffers as it found them, and those it updated left alone) and backpropagate the gradients of its
        outputs."""
        random_state = shard.random_state if replay else None
        with (
            random_state.replayed() if random_state is not None else nullcontext(),
            shard.buffers.replayed() if shard.buffers is not None else nullcontext(),
            torch.enable_grad(),
            self._dtypes.replayed(),
        ):
            produced = self._run(shard, training=True)
            if random_state is not None:
                _check_replayed(shard, random_state)
        outputs, grads = [], []
        for src, value in produced.items():
            leaf = self._boundaries.get(src)
            if isinstance(leaf, Tensor) and leaf is not value and leaf.grad is not None and value.requires_grad:
                outputs.append(value)
                grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)

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
            with self.turn("step", shard.index):
                self._bring(shard, ("grads", "state"))
                with self._fetching(shard.index + 1, ("grads", "state")):
                    if clip is not None and total is not None:
                        clip(shard.params, total)
                    self._step_shard(optimizer, shard.params)
                self._evict(shard, write=("params", "grads", "state"))
        if self.resident_params:
            with self.turn("step", len(self.shards)):
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
            self._prefetch(shard.index + 1, parts)
            try:
                yield shard.params
            finally:
                self._evict(shard, write=write)
        yield self.resident_params

    def restore(self, device: torch.device) -> None:
        """Put every shard's parameters, gradients and optimizer state back into the model for good (after
        training), on ``device``, a shard at a time; drop the store."""
        for shard in self.shards:
            self._bring(shard, ("grads", "state"))
            for p in shard.params:
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
                if self._optimizer is not None:
                    state = self._optimizer.state.get(p, {})
                    state.update({k: v.to(device) for k, v in state.items() if _spilled_with_shard(v)})
        self.store.close()


def _check_replayed(shard: Shard, random_state: RandomState) -> None:
    """A recompute that drew random numbers must end where its forward ended, or its dropout masks differ."""
    replayed = generator_states(random_state.device)
    drew = states_differ(random_state.states, replayed)
    if drew and states_differ(replayed, shard.random_after):  # type: ignore[arg-type]
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
