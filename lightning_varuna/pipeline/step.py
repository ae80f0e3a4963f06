"""Run one step of a LightningModule (``training_step``, ``validation_step``, ...) over the micro-batches of a batch
through this rank's pipeline stage.

The step owns the schedule's loop (`run_schedule`, as torch's `_step_microbatches`; `MicroBatchedStep` runs it): it
walks this stage's actions and, per action, runs the user's step on a micro-batch (whose ``self(...)`` runs the stage
runtime's forward), or the runtime's recompute, backward or weight pass; the runtime never calls back into the step.

This is the one place that changes the user's module while a step runs, and only for the step's duration:

- ``module.forward`` runs this rank's stage on the micro-batch whose step is running. On a stage other than the last
  it ends the user's step there (by raising `StageForwardDone`, a ``BaseException`` that a user's
  ``except Exception`` does not swallow): the rest of the step needs the model's output, which only the last stage
  has.
- ``module.log`` records into a `LogRecorder`: values are combined over micro-batches by their ``reduce_fx``,
  sent from the last stage to the others and logged once per batch (`replay`).

A step must call ``self(...)`` exactly once: the other stages send and wait for the messages of one forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from lightning_varuna.data.microbatch import batch_size_of, merge_microbatches, split_microbatches
from lightning_varuna.pipeline.runtime import StageRuntime
from lightning_varuna.pipeline.schedules import Action, Phase
from lightning_varuna.pipeline.stage import Stage
from lightning_varuna.pipeline.step_logging import LogRecorder
from lightning_varuna.random_states import global_random_states_kept, step_state_kept

__all__ = ["MicroBatchedStep", "StageForwardDone", "capture_forward_inputs", "patched_forward", "run_schedule"]


class StageForwardDone(BaseException):
    """Ends a user step on a stage that is not the last: the rest of the step needs the model's output."""


class MicroBatchedStep:
    """``module.<step_name>(batch, *rest, **kwargs)`` run as micro-batches of ``micro_batch_size`` rows through
    ``stage`` under the schedule ``actions`` (this stage's list).

    Args:
        loss_weight: the factor each micro-batch's loss gets on top of its share of the batch's items (training):
            this replica's share of the items of all replicas / accumulated batches, so that the summed gradients
            are the mean.
        scale_loss: the grad scaler's ``scale`` (fp16), or None.
        loss_items: the number of items a (micro-)batch's loss is the mean of (None: its rows); a micro-batch's
            loss and logged values are weighted by its share of the batch's items.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        stage: Stage,
        step_name: str,
        rest: tuple,
        kwargs: dict,
        *,
        loss_weight: float = 1.0,
        scale_loss: Callable[[Tensor], Tensor] | None = None,
        loss_items: Callable[[Any], Any] | None = None,
    ) -> None:
        self.module, self.stage, self.step_name = module, stage, step_name
        self.rest, self.kwargs = rest, kwargs
        self.loss_weight, self.scale_loss = loss_weight, scale_loss
        self.loss_items = loss_items or batch_size_of
        self.recorder = LogRecorder(training=step_name == "training_step")
        self._microbatches: list[Any] = []
        self._weights: list[float] = []
        self._next_alike: list[bool] = []  # whether micro-batch m + 1 has m's shapes (its receives post early)

    def run(
        self, batch: Any, micro_batch_size: int, actions: list[Action], *, training: bool, on_wait: Callable[[], None]
    ) -> Any:
        """Run the step on every micro-batch; return the merged step output on the last stage (None elsewhere).

        Args:
            on_wait: called every half second while the stage waits for a message; it raises to stop waiting (a peer
                failed, the process was asked to end), which abandons the batch.
        """
        self._microbatches = split_microbatches(batch, micro_batch_size)
        items = [float(self.loss_items(mb)) for mb in self._microbatches]
        if sum(items) <= 0:
            raise ValueError(
                f"`loss_items` counted {items} items in the micro-batches of a batch: a loss needs at least one item "
                "in its batch (a batch whose labels are all ignored has no mean); leave such batches out."
            )
        self._weights = [count / sum(items) for count in items]
        shapes = [_shapes(mb) for mb in self._microbatches]
        self._next_alike = [a == b for a, b in zip(shapes, shapes[1:])] + [False]
        with self.recorder.capture(self.module):
            step_outputs = self._step_microbatches(actions, training, on_wait)
        return merge_microbatches(step_outputs, self._weights) if self.stage.runtime.is_last_stage else None

    def _step_microbatches(self, actions: list[Action], training: bool, on_wait: Callable[[], None]) -> list[Any]:
        """Execute this stage's ``actions``, each forward running the user's step on its micro-batch; return each
        micro-batch's step output (None on stages other than the last)."""
        return run_schedule(
            self.stage.runtime,
            actions,
            lambda stage, m, recompute_later: self._run_user_step(stage, m, training, recompute_later, on_wait),
            self._loss_of,
            on_wait,
        )

    def _run_user_step(
        self, stage: int, m: int, training: bool, recompute_later: bool, on_wait: Callable[[], None]
    ) -> Any:
        """The user's step on micro-batch ``m``, its ``self(...)`` running ``stage``'s forward of ``m``: its output,
        or None on a stage other than the last, where that forward ends the step."""
        forwards = 0

        def stage_forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal forwards
            if forwards:
                raise TypeError(
                    self._one_forward("called `self(...)` a second time")
                    + "Compute everything the step needs from one call's output (`forward` may return several)."
                )
            forwards += 1
            graph, stage_module = self.stage.stage_for(args, kwargs, stage)
            inputs = tree_leaves((args, kwargs))
            output = self.stage.runtime.forward(
                m, graph, stage_module, inputs, training, stage=stage, recompute_later=recompute_later,
                on_wait=on_wait, next_alike=self._next_alike[m],
            )  # fmt: skip
            if output is None:
                raise StageForwardDone
            return output

        self.recorder.weight = self._weights[m]
        with patched_forward(self.module, stage_forward):
            try:
                step_output = getattr(self.module, self.step_name)(self._microbatches[m], *self.rest, **self.kwargs)
            except StageForwardDone:
                return None
        if not forwards:
            raise TypeError(
                self._one_forward("returned without calling `self(...)`")
                + "To leave a batch out, filter it out of the DataLoader, or (in training) multiply its loss by 0."
            )
        return step_output

    def _loss_of(self, m: int, step_output: Any) -> Tensor | None:
        if not self.stage.runtime.is_last_stage:
            return None
        loss = step_output["loss"] if isinstance(step_output, dict) else step_output
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"`training_step` returned {type(step_output).__name__}; with VarunaStrategy it must return the "
                "loss tensor or a dict with a `loss` tensor on every batch."
            )
        # Weighted by the micro-batch's share of all items of the optimizer step (over replicas and accumulated
        # batches): the summed gradients are the mean, scaled as one device scales them (same fp16 overflows).
        loss = loss * (self._weights[m] * self.loss_weight)
        return self.scale_loss(loss) if self.scale_loss is not None else loss

    def _one_forward(self, what: str) -> str:
        batch = f" on batch {self.rest[0]}" if self.rest and isinstance(self.rest[0], int) else ""
        return (
            f"`{type(self.module).__name__}.{self.step_name}` {what}{batch}. VarunaStrategy pipelines the forward of "
            "each step: the other stages send and wait for the messages of exactly one `self(...)` per step. "
        )


def run_schedule(
    runtime: StageRuntime,
    actions: list[Action],
    forward: Callable[[int, int, bool], Any],
    loss_of: Callable[[int, Any], Tensor | None],
    on_wait: Callable[[], None] | None = None,
) -> list[Any]:
    """Execute one rank's ``actions`` in order (as torch's ``_step_microbatches``), whichever of its stages each
    names: a forward is ``forward(stage, m, recompute_later)``, whose output ``loss_of(m, output)`` turns into the loss
    the backward of ``m`` starts from (on the last stage; None elsewhere); recomputes, backwards and deferred weight
    passes go to ``runtime``. Returns each micro-batch's forward output of the rank's last stage, in micro-batch
    order. Any failure abandons the batch: its sends may never be received."""
    stage_of = {a: a.stage if a.stage is not None else runtime.stage_index for a in actions}
    recomputed = {(stage_of[a], a.microbatch) for a in actions if a.phase is Phase.RECOMPUTE}
    deferred_weights = {(stage_of[a], a.microbatch) for a in actions if a.phase is Phase.WEIGHT}
    last = runtime.num_stages - 1
    outputs: dict[tuple[int, int], Any] = {}
    try:
        for action in actions:
            key = stage, m = stage_of[action], action.microbatch
            with runtime.timing(action):
                if action.phase is Phase.FORWARD:
                    outputs[key] = forward(stage, m, key in recomputed)
                elif action.phase is Phase.RECOMPUTE:
                    runtime.recompute(m, stage=stage)
                elif action.phase is Phase.BACKWARD:
                    loss = loss_of(m, outputs[key]) if stage == last else None
                    runtime.backward(m, loss, on_wait, stage=stage, weights_later=key in deferred_weights)
                    # What merges the outputs reads only values; their graph, kept, would keep what a split
                    # backward's input part left for no weight pass (the loss's side, freed when unreferenced).
                    outputs[key] = tree_map(_detached, outputs[key])
                else:
                    runtime.backward_weights(m, stage=stage)
        runtime.finish(on_wait)
    except BaseException:
        runtime.abandon_batch()
        raise
    own_last = max(runtime.stage_indices)
    return [outputs[key] for key in sorted(outputs) if key[0] == own_last]


def _shapes(microbatch: Any) -> list[Any]:
    """The shapes and dtypes of a micro-batch's tensors, and its other leaves as they are."""
    return [(x.shape, x.dtype) if isinstance(x, Tensor) else x for x in tree_leaves(microbatch)]


def capture_forward_inputs(module: pl.LightningModule, step_name: str, microbatch: Any) -> tuple[tuple, dict]:
    """The arguments the step passes to ``self(...)`` for ``microbatch``, found by running the step up to that call
    (without gradients, logging nothing, and leaving the random numbers the run draws next, and the module's state
    that `step_state_kept` keeps, as they were)."""
    captured: list[tuple[tuple, dict]] = []

    def capture(*args: Any, **kwargs: Any) -> None:
        captured.append((args, kwargs))
        raise StageForwardDone

    with (
        global_random_states_kept(),
        step_state_kept(module),
        torch.no_grad(),
        LogRecorder().capture(module),
        patched_forward(module, capture),
        suppress(StageForwardDone),
    ):
        getattr(module, step_name)(microbatch, 0)
    if not captured:
        raise RuntimeError(
            f"`{type(module).__name__}.{step_name}` never called `self(...)`; VarunaStrategy and SpillingStrategy "
            "run the forward call of each step in parts (stages or shards). Call the model through `self(...)` once "
            "per step: a submodule called directly (`self.net(x)`) is not cut, and runs whole."
        )
    return captured[0]


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


@contextmanager
def patched_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module(...)`` calls ``forward`` inside the block."""
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward
