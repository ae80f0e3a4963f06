"""One rank of a job that drives the pipeline's engine without a Trainer: the pieces VarunaStrategy (and the
spilling strategy) build on, used directly (tests/test_engine.py starts its 4 ranks with `forked_ranks`; torchrun
runs it too)::

    python -m torch.distributed.run --nproc-per-node=4 tests/run_engine.py OUT_DIR

One job, two layouts in turn (one start-up for all the checks):

- ``four``: 4 stages of one replica. The bare `StageRuntime` under GPipe, 1F1B and Varuna's schedule (recomputes),
  on the whole batch, each from zero gradients: the stage's gradients as the runtime left them and after
  `reduce_gradients` (the tied embedding / head summed over stages 0 and 3); the last stage's outputs; and the
  outputs of a forward-only pass.
- ``replicas``: 2 stages x 2 replicas, each replica on its half of the batch. The runtime under GPipe and 1F1B (the
  gradients before the sum over replicas); then `reduce_gradients`, `clip_grad_norm_across_stages` and
  `broadcast_buffers`; then `MicroBatchedStep` running TinyLM's ``training_step`` under Varuna's schedule, and
  `reduce_gradients` again.

Each rank writes ``OUT_DIR/{layout}-rank{r}.pt``: gradients by parameter name, outputs, norms and losses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.dirname(__file__))
from models import TinyLM, token_dataset  # noqa: E402

from lightning_varuna.pipeline.gradients import (  # noqa: E402
    broadcast_buffers,
    clip_grad_norm_across_stages,
    reduce_gradients,
)
from lightning_varuna.pipeline.schedules import SCHEDULES, Action, forward_only  # noqa: E402
from lightning_varuna.pipeline.shared_params import SharedParameters  # noqa: E402
from lightning_varuna.pipeline.stage import Stage  # noqa: E402
from lightning_varuna.pipeline.step import MicroBatchedStep, run_schedule  # noqa: E402
from lightning_varuna.pipeline.topology import PipelineGroups, Topology  # noqa: E402

BATCH, MICRO_BATCH = 16, 2
CLIP = 0.05  # below the gradients' norm, so clipping changes them
BOUNDARIES = {4: ["cuts.0", "cuts.1", "cuts.3"], 2: ["cuts.2"]}  # uneven stages: one block on some, two on others


def batch() -> tuple[Tensor, Tensor]:
    """The global batch every run trains on (and the reference, in one piece)."""
    idx, y = token_dataset(BATCH).tensors
    return idx, y


def build_stage(topo: Topology, groups: PipelineGroups, example: Tensor) -> tuple[TinyLM, Stage]:
    """A fresh TinyLM (seed 0, as the reference) cut into this rank's stage, tied weights found as
    `pipeline.stage_plan.plan_stage` finds them."""
    torch.manual_seed(0)
    model = TinyLM()
    boundaries = BOUNDARIES[topo.pipeline_parallel_size]
    stage = Stage(model, boundaries, topo, torch.device("cpu"), groups.messages)
    graph, _ = stage.stage_for((example,), {})
    stage.release_other_stages(graph)
    stage.shared = SharedParameters(graph.stage_parameters, topo, dict(model.named_parameters()))
    return model, stage


def run_runtime(
    stage: Stage,
    actions: list[Action],
    xs: tuple[Tensor, ...],
    ys: tuple[Tensor, ...],
    weight: float,
    training: bool = True,
) -> list[Any]:
    """The bare runtime under ``actions`` on the micro-batches ``xs``, walked by the step's loop (`run_schedule`, as
    the benchmark does), each loss scaled by ``weight``."""

    def forward(index: int, m: int, recompute_later: bool) -> Tensor | None:
        graph, stage_module = stage.stage_for((xs[m],), {}, index)
        return stage.runtime.forward(
            m, graph, stage_module, [xs[m]], training, stage=index, recompute_later=recompute_later
        )

    def loss_of(m: int, logits: Tensor | None) -> Tensor | None:
        return None if logits is None else F.cross_entropy(logits.flatten(0, 1), ys[m].flatten()) * weight

    return run_schedule(stage.runtime, actions, forward, loss_of)


def zero_grads(stage: Stage) -> None:
    for p in stage.own_parameters():
        p.grad = None


def grads_of(model: TinyLM) -> dict[str, Tensor]:
    """This rank's gradients by parameter name (the parameters of other stages are released)."""
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def reduce(stage: Stage, groups: PipelineGroups, replicas: int) -> None:
    """`reduce_gradients` as the strategy calls it, its result put back into ``.grad``."""
    params = stage.own_parameters()
    for p, grad in zip(
        params, reduce_gradients(params, [p.grad for p in params], groups.replicas, replicas, stage.shared)
    ):
        p.grad = grad


def four_stages(out: Path) -> None:
    rank = dist.get_rank()
    topo = Topology.from_world(dist.get_world_size(), rank, 4, None)
    groups = topo.process_groups()
    idx, y = batch()
    xs, ys = idx.split(MICRO_BATCH), y.split(MICRO_BATCH)
    model, stage = build_stage(topo, groups, xs[0])
    result: dict[str, Any] = {"rank": rank, "pp_rank": topo.pp_rank, "shared": stage.shared.names}
    result["names"] = [name for name, _ in model.named_parameters()]
    for schedule in ("gpipe", "1f1b", "varuna", "zero-bubble"):
        zero_grads(stage)
        actions = SCHEDULES[schedule](topo.pipeline_parallel_size, len(xs))[topo.pp_rank]
        outputs = run_runtime(stage, actions, xs, ys, 1 / len(xs))
        raw = grads_of(model)
        reduce(stage, groups, 1)
        result[schedule] = {"grads": raw, "reduced": grads_of(model), "outputs": outputs}
    zero_grads(stage)
    with torch.no_grad():
        actions = forward_only(topo.pipeline_parallel_size, len(xs))[topo.pp_rank]
        result["forward_only"] = run_runtime(stage, actions, xs, ys, 1.0, training=False)
    result["grads_after_forward_only"] = grads_of(model)
    torch.save(result, out / f"four-rank{rank}.pt")


def two_stages_two_replicas(out: Path) -> None:
    rank = dist.get_rank()
    topo = Topology.from_world(dist.get_world_size(), rank, 2, None)
    groups = topo.process_groups()
    replicas = topo.data_parallel_size
    idx, y = (t.chunk(replicas)[topo.dp_rank] for t in batch())  # this replica's rows
    xs, ys = idx.split(MICRO_BATCH), y.split(MICRO_BATCH)
    model, stage = build_stage(topo, groups, xs[0])
    result: dict[str, Any] = {
        "rank": rank,
        "pp_rank": topo.pp_rank,
        "dp_rank": topo.dp_rank,
        "shared": stage.shared.names,
    }
    result["names"] = [name for name, _ in model.named_parameters()]
    for schedule in ("gpipe", "1f1b"):
        zero_grads(stage)
        actions = SCHEDULES[schedule](topo.pipeline_parallel_size, len(xs))[topo.pp_rank]
        outputs = run_runtime(stage, actions, xs, ys, 1 / (replicas * len(xs)))
        result[schedule] = {"grads": grads_of(model), "outputs": outputs}
    reduce(stage, groups, replicas)  # the gradients of 1F1B's run
    result["reduced"] = grads_of(model)
    params = stage.own_parameters()
    counted = stage.shared.counted_once(params)
    result["norm"] = clip_grad_norm_across_stages(params, counted, CLIP, groups.stages, topo.pipeline_parallel_size)
    result["clipped"] = grads_of(model)

    buffers = [torch.full((3,), float(rank)), torch.arange(4.0) * (rank + 1)]
    broadcast_buffers(buffers, groups.replicas, topo.replica_ranks()[0], replicas)
    result["buffers"] = buffers

    zero_grads(stage)
    actions = SCHEDULES["varuna"](topo.pipeline_parallel_size, len(xs))[topo.pp_rank]
    step = MicroBatchedStep(model, stage, "training_step", (0,), {}, loss_weight=1 / replicas)
    loss = step.run((idx, y), MICRO_BATCH, actions, training=True, on_wait=lambda: None)
    result["step"] = {
        "loss": loss,
        "logged": {name: getattr(value, "step_value", value) for name, value, _ in step.recorder.summary()},
        "grads": grads_of(model),
    }
    reduce(stage, groups, replicas)
    result["step"]["reduced"] = grads_of(model)
    torch.save(result, out / f"replicas-rank{rank}.pt")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    four_stages(out)
    dist.barrier()
    two_stages_two_replicas(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
