"""One rank's pipeline stages' work on the micro-batches of a batch: their forwards, recomputes, backwards and weight
passes, talking to the other stages with asynchronous point-to-point sends and receives (and, between two stages of one
rank under an interleaved schedule, through a local mailbox). The step (`pipeline.step`) walks the schedule and calls
these; nothing here calls back into it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_unflatten

from lightning_varuna.partition.split import PipelineGraph, Source
from lightning_varuna.pipeline.host_staging import StagedReceive, host_buffer_like, host_copy, stages_through_host
from lightning_varuna.pipeline.replay import BufferState, RandomState
from lightning_varuna.pipeline.schedules import Action, Phase
from lightning_varuna.pipeline.split_backward import SplitBackward, WeightPass
from lightning_varuna.pipeline.waiting import Waiter

__all__ = ["StageRuntime"]

_MAX_VALUES_PER_EDGE = 1024


def _tag(producer_round: int, consumer_round: int, per_rank: int, microbatch: int, slot: int, phase: Phase) -> int:
    """One message's tag: the same on both sides, and distinct for each edge between the stages of two ranks. With
    several stages per rank (round-robin), two ranks may hold several pairs of stages that talk, and a stage may send a
    value to several stages of one rank: the edge is told apart by which of its rank's stages (``*_round``, of
    ``per_rank``) each end is. With one stage per rank the tag is the micro-batch's, slot's and direction's alone."""
    edge = (microbatch * per_rank + producer_round) * per_rank + consumer_round
    return (edge * _MAX_VALUES_PER_EDGE + slot) * 2 + (phase is Phase.BACKWARD)


class _LocalReceive:
    """A receive from a stage of this rank: the sent tensor, taken from the mailbox when waited for."""

    def __init__(self, mailbox: dict[int, Tensor], tag: int, buffer: Tensor) -> None:
        self._mailbox, self._tag, self._buffer = mailbox, tag, buffer

    def wait(self) -> bool:
        if self._tag not in self._mailbox:
            raise RuntimeError(
                "A stage waits for a message from another stage of its own rank that the schedule has not sent yet: "
                "the schedule runs an action before one it depends on on the same rank (check it with `dry_run`)."
            )
        self._buffer.copy_(self._mailbox.pop(self._tag))
        return True


# A receive posted for a forward: the (producer, value) it receives, its buffer, and its work.
_Receive: TypeAlias = "dist.Work | _LocalReceive | StagedReceive"
_Posted = tuple[tuple[int, int], Tensor, _Receive]


def _as_tuple(outputs: Any) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


class StageRuntime:
    """Runs the forwards, recomputes, backwards and weight passes of a rank's stages (one, or several under an
    interleaved schedule) for the micro-batches of a batch, in the order the caller gives (its schedule's), then
    `finish` (or `abandon_batch` after a failure). Each call names its stage (``stage=``; default: the rank's first).

    The stage module may differ between micro-batches (a smaller last micro-batch is traced on its own);
    all of them share one `PipelineGraph` layout, so the messages between stages are the same.

    Args:
        stage_indices: the stages this rank runs.
        stage_ranks: global rank of each stage of this rank's replica, in stage order.
        device: where received tensors are put.
        message_groups: two process groups over the stages of this replica, one for the activations and one for
            the gradients (default: the global group for both). NCCL runs the messages between two ranks of one
            group in the order they were posted, one after another: an early gradient receive would then hold up
            the activations sent after it, which the next stage may need first. In their own groups each kind
            flows in micro-batch order, as every schedule sends and receives it.
    """

    def __init__(
        self,
        stage_indices: Sequence[int],
        stage_ranks: Sequence[int],
        device: torch.device,
        message_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
    ):
        self.stage_indices = tuple(stage_indices)
        self._ranks = list(stage_ranks)
        self._local: dict[int, Tensor] = {}  # messages between two stages of this rank, by tag
        self._message_groups = message_groups
        self._device = device
        # By (stage, micro-batch):
        self._received: dict[tuple[int, int], dict[tuple[int, int], Tensor]] = {}
        self._sent: dict[tuple[int, int], dict[int, Tensor]] = {}
        self._graphs: dict[tuple[int, int], PipelineGraph] = {}
        self._modules: dict[tuple[int, int], nn.Module] = {}
        self._split = SplitBackward()
        self._weight_passes: dict[tuple[int, int], WeightPass] = {}
        self._grad_recvs: dict[tuple[int, int], list[tuple[int, int, Tensor, _Receive]]] = {}
        self._early: dict[tuple[int, int], list[_Posted]] = {}  # activation receives posted, until they arrive
        self._pending_sends: list[tuple[dist.Work, Tensor]] = []
        self.timeline: list[tuple[str, float, float]] | None = None  # when recording: (action, start, end)
        self._compute_start: float | None = None  # when the running action's messages arrived (see `timing`)
        self._stashed: dict[tuple[int, int], tuple[nn.Module, list[Any], RandomState, BufferState]] = {}
        self._waiter: Waiter | None = None
        # Sends of failed batches, never waited for: kept referenced while the backend may still read their tensors.
        self._abandoned_sends: list[tuple[dist.Work, Tensor]] = []
        # and their receives, still posted: (buffer, work), the buffer maybe still written
        self._abandoned_receives: list[tuple[Tensor, _Receive]] = []

    @property
    def stage_index(self) -> int:
        """The rank's first stage (with one stage per rank: its stage)."""
        return self.stage_indices[0]

    @property
    def num_stages(self) -> int:
        return len(self._ranks)

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (which returns the model's output)."""
        return self.num_stages - 1 in self.stage_indices

    def _stage(self, stage: int | None) -> int:
        return self.stage_index if stage is None else stage

    def forward(
        self,
        microbatch: int,
        graph: PipelineGraph,
        module: nn.Module,
        model_inputs: Sequence[Any],
        training: bool,
        *,
        stage: int | None = None,
        recompute_later: bool = False,
        on_wait: Callable[[], None] | None = None,
        next_alike: bool = False,
    ) -> Any:
        """Run a stage of this rank on one micro-batch and send its outputs on.

        Args:
            stage: the stage (default: the rank's first); ``module`` is its module.
            recompute_later: the schedule recomputes this forward before its backward (`recompute`): keep only its
                inputs and random state now, not its activations.
            on_wait: called every half second while this stage waits for a message; it raises to stop waiting (a
                peer failed, the process was asked to end), and the caller then abandons the batch.
            next_alike: this stage's next forward (micro-batch ``microbatch + 1``) receives values of the same
                shapes: its receives are posted now, as this one's have arrived, so that its activations travel
                while this forward computes (gloo sends a message only once its receive is posted).

        Returns:
            On the last stage, the model's output for the micro-batch; ``None`` elsewhere.
        """
        stage = self._stage(stage)
        key = (stage, microbatch)
        received = self._receive_activations(stage, microbatch, graph, training, on_wait)
        if next_alike and self.waiter.backend == dist.Backend.GLOO:  # NCCL would run it before this rank's own sends
            self._early[(stage, microbatch + 1)] = self._post_activation_receives(stage, microbatch + 1, graph)
        self._compute_start = time.time()
        args = [self._lookup(stage, src, model_inputs, received, None) for src in graph.stage_inputs[stage]]
        if recompute_later:
            # Keep only the inputs (and the random state); `recompute` rebuilds the activations later.
            buffers = BufferState([module])
            self._stashed[key] = (module, args, RandomState(self._device), buffers)
            with torch.no_grad():
                outputs = _as_tuple(module(*args))
        else:
            outputs = _as_tuple(module(*args))
        sent = self._wire_values(stage, graph, outputs)
        for consumer, values in graph.sends(stage).items():
            for slot, value in enumerate(values):
                self._isend(sent[value], stage, consumer, microbatch, slot, Phase.FORWARD)
        if training:
            self._received[key] = received
            if not recompute_later:
                self._sent[key] = sent
            self._graphs[key] = graph
            self._modules[key] = module
            self._post_grad_receives(stage, microbatch, graph)
        if stage != self.num_stages - 1:
            return None
        leaves = [self._lookup(stage, src, model_inputs, received, outputs) for src in graph.output_sources]
        return tree_unflatten(leaves, graph.output_spec)

    def recompute(self, microbatch: int, *, stage: int | None = None) -> None:
        """Run a forward again from its kept inputs and random state, this time keeping its activations."""
        key = (self._stage(stage), microbatch)
        module, args, random_state, buffers = self._stashed.pop(key)
        # As the forward ran: its random numbers and the buffers it found (it updated them; the replay must not).
        with random_state.replayed(), buffers.replayed():
            outputs = _as_tuple(module(*args))
        self._sent[key] = self._wire_values(key[0], self._graphs[key], outputs)

    def backward(
        self,
        microbatch: int,
        loss: Tensor | None,
        on_wait: Callable[[], None] | None = None,
        *,
        stage: int | None = None,
        weights_later: bool = False,
    ) -> None:
        """Back-propagate one micro-batch through a stage of this rank and send the input gradients back.

        Args:
            stage: the stage (default: the rank's first).
            loss: on the last stage, the (already weighted) loss of the micro-batch.
            on_wait: as for `forward`.
            weights_later: compute only the inputs' gradients now and the parameters' at `backward_weights`
                (zero-bubble; see `SplitBackward`).
        """
        stage = self._stage(stage)
        key = (stage, microbatch)
        graph = self._graphs.pop(key)
        module = self._modules.pop(key)
        received = self._received.pop(key)
        sent = self._sent.pop(key)
        tensors, grads = [], []
        if loss is not None and loss.requires_grad:
            tensors, grads = [loss], [torch.ones_like(loss)]
        grad_recvs = self._grad_recvs.get(key, [])
        self._wait([work for *_, work in grad_recvs], on_wait)
        self._grad_recvs.pop(key, None)
        summed: dict[int, Tensor] = {}
        for _, value, grad, _ in grad_recvs:
            summed[value] = summed[value] + grad if value in summed else grad
        self._compute_start = time.time()
        for value, grad in summed.items():
            if sent[value].requires_grad:
                tensors.append(sent[value])
                grads.append(grad)
        if weights_later:
            inputs = [tensor for tensor in received.values() if tensor.requires_grad]
            self._weight_passes[key] = self._split.input_part(module, tensors, grads, inputs)
        elif tensors:
            torch.autograd.backward(tensors, grads)
        for producer, values in graph.receives(stage).items():
            for slot, value in enumerate(values):
                tensor = received[(producer, value)]
                if graph.stage_outputs[producer][value].needs_grad:
                    grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                    self._isend(grad, producer, stage, microbatch, slot, Phase.BACKWARD)

    def backward_weights(self, microbatch: int, *, stage: int | None = None) -> None:
        """Add the parameters' gradients of a micro-batch whose `backward` computed only its inputs'."""
        self._weight_passes.pop((self._stage(stage), microbatch))()

    @contextmanager
    def timing(self, action: Action) -> Iterator[None]:
        """Add the span of ``action``, run inside the block, to `timeline` when it records. The span begins once the
        action's messages arrived: the time spent waiting for a peer is not the action's."""
        start, self._compute_start = time.time(), None
        yield
        if self.timeline is not None:
            self.timeline.append((str(action), self._compute_start or start, time.time()))

    def take_timeline(self) -> list[tuple[str, float, float]]:
        """Stop recording; the ``(action, start, end)`` recorded, in wall-clock seconds."""
        timeline, self.timeline = self.timeline or [], None
        return timeline

    def finish(self, on_wait: Callable[[], None] | None = None) -> None:
        """Wait for every send of the batch and drop what is left of its state (``on_wait`` as for `forward`)."""
        self._wait([work for work, _ in self._pending_sends], on_wait)
        self._pending_sends.clear()
        self._drop_batch()

    def abandon_batch(self) -> None:
        """Drop the batch after a failure, without waiting for its sends: the peers may never receive them."""
        self._abandoned_sends += self._pending_sends
        self._pending_sends = []
        for posted in self._early.values():
            self._abandoned_receives += [(buffer, work) for _, buffer, work in posted]
        for grads in self._grad_recvs.values():
            self._abandoned_receives += [(buffer, work) for *_, buffer, work in grads]
        self._drop_batch()

    def _drop_batch(self) -> None:
        self._received.clear()
        self._sent.clear()
        self._graphs.clear()
        self._modules.clear()
        self._weight_passes.clear()
        self._grad_recvs.clear()
        self._early.clear()
        self._stashed.clear()
        self._local.clear()

    def _wire_values(self, stage: int, graph: PipelineGraph, outputs: tuple) -> dict[int, Tensor]:
        """The outputs ``stage`` sends, by value index, in the traced dtype (autocast may have changed it)."""
        metas = graph.stage_outputs[stage]
        values = {value for values in graph.sends(stage).values() for value in values}
        return {value: outputs[value].to(metas[value].dtype) for value in sorted(values)}

    def _lookup(
        self,
        stage: int,
        src: Source,
        model_inputs: Sequence[Any],
        received: dict[tuple[int, int], Tensor],
        outputs: tuple | None,
    ) -> Any:
        if src.stage is None:
            return model_inputs[src.index]
        if src.stage == stage:
            assert outputs is not None
            return outputs[src.index]
        return received[(src.stage, src.index)]

    def _receive_activations(
        self, stage: int, microbatch: int, graph: PipelineGraph, training: bool, on_wait: Callable[[], None] | None
    ) -> dict[tuple[int, int], Tensor]:
        at = (stage, microbatch)  # kept in `_early` until received, for `abandon_batch`
        if at not in self._early:
            self._early[at] = self._post_activation_receives(stage, microbatch, graph)
        works = self._early[at]
        self._wait([work for *_, work in works], on_wait)
        del self._early[at]
        received = {}
        for key, buffer, _ in works:
            producer, value = key
            if training and graph.stage_outputs[producer][value].needs_grad:
                buffer.requires_grad_()
            received[key] = buffer
        return received

    def _post_activation_receives(self, stage: int, microbatch: int, graph: PipelineGraph) -> list[_Posted]:
        """Post the receives of ``stage``'s forward of ``microbatch``: (producer, value), buffer and the work each."""
        posted = []
        for producer, values in graph.receives(stage).items():
            for slot, value in enumerate(values):
                meta = graph.stage_outputs[producer][value]
                buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self._device)
                work = self._irecv(buffer, producer, stage, microbatch, slot, Phase.FORWARD)
                posted.append(((producer, value), buffer, work))
        return posted

    def _post_grad_receives(self, stage: int, microbatch: int, graph: PipelineGraph) -> None:
        posted = []
        for consumer, values in graph.sends(stage).items():
            for slot, value in enumerate(values):
                meta = graph.stage_outputs[stage][value]
                if meta.needs_grad:
                    buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self._device)
                    posted.append(
                        (
                            consumer,
                            value,
                            buffer,
                            self._irecv(buffer, stage, consumer, microbatch, slot, Phase.BACKWARD),
                        )
                    )
        self._grad_recvs[(stage, microbatch)] = posted

    @property
    def waiter(self) -> Waiter:
        """Where this stage waits for its peers (`Waiter`): its messages, and what else a step waits for."""
        if self._waiter is None:
            self._waiter = Waiter(dist.get_backend(self._message_groups[0]))
        return self._waiter

    def _wait(self, works: Sequence[_Receive], on_wait: Callable[[], None] | None) -> None:
        if works:
            self.waiter.call(lambda: [work.wait() for work in works], on_wait)

    def _tag(self, producer: int, consumer: int, microbatch: int, slot: int, phase: Phase) -> int:
        positions = len(set(self._ranks))  # stage s runs on position s % positions
        return _tag(producer // positions, consumer // positions, self.num_stages // positions, microbatch, slot, phase)

    def _isend(self, tensor: Tensor, producer: int, consumer: int, microbatch: int, slot: int, phase: Phase) -> None:
        """Send a value of the edge ``producer`` -> ``consumer``: forward (an activation) to the consumer, backward (its
        gradient) to the producer."""
        tensor = tensor.detach().contiguous()
        tag = self._tag(producer, consumer, microbatch, slot, phase)
        peer = self._ranks[producer if phase is Phase.BACKWARD else consumer]
        if peer == self._ranks[self.stage_index]:
            self._local[tag] = tensor
            return
        group = self._message_groups[phase is Phase.BACKWARD]
        if stages_through_host(self._device, self.waiter.backend):
            tensor = host_copy(tensor)
        work = dist.isend(tensor, peer, group=group, tag=tag)
        assert work is not None  # this rank is in the group
        self._pending_sends.append((work, tensor))

    def _irecv(
        self, buffer: Tensor, producer: int, consumer: int, microbatch: int, slot: int, phase: Phase
    ) -> _Receive:
        """Receive into ``buffer`` a value of the edge ``producer`` -> ``consumer`` (see `_isend`)."""
        tag = self._tag(producer, consumer, microbatch, slot, phase)
        peer = self._ranks[consumer if phase is Phase.BACKWARD else producer]
        if peer == self._ranks[self.stage_index]:
            return _LocalReceive(self._local, tag, buffer)
        group = self._message_groups[phase is Phase.BACKWARD]
        if stages_through_host(self._device, self.waiter.backend):
            host = host_buffer_like(buffer)
            staged = dist.irecv(host, peer, group=group, tag=tag)
            assert staged is not None  # this rank is in the group
            return StagedReceive(staged, host, buffer)
        work = dist.irecv(buffer, peer, group=group, tag=tag)
        assert work is not None  # this rank is in the group
        return work
