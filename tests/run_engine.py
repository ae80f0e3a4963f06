"""One rank of a pipelined training step driven without a Trainer: the pieces VarunaStrategy (and the spilling
strategy) build on, used directly (tests/test_engine.py starts it with torchrun)::

    python -m torch.distributed.run --nproc-per-node=4 tests/run_engine.py OUT_DIR '{"pp": 2, ...}'

Each rank writes ``OUT_DIR/rank{r}.pt``: its stage's gradients after the replica sum, the tied-weight sum and
clipping, by parameter name; the global norm; and (last stage) the step's loss.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(__file__))
from models import TinyLM, token_dataset  # noqa: E402

from lightning_varuna.pipeline.gradients import clip_grad_norm_across_stages, reduce_gradients  # noqa: E402
from lightning_varuna.pipeline.schedules import SCHEDULES  # noqa: E402
from lightning_varuna.pipeline.shared_params import SharedParameters  # noqa: E402
from lightning_varuna.pipeline.stage import Stage  # noqa: E402
from lightning_varuna.pipeline.step import MicroBatchedStep  # noqa: E402
from lightning_varuna.pipeline.topology import Topology  # noqa: E402

BATCH, MICRO_BATCH = 16, 2


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch every run trains on (and the reference, in one piece)."""
    idx, y = token_dataset(BATCH).tensors
    return idx, y


def main(out: Path, config: dict) -> None:
    dist.init_process_group("gloo")
    topo = Topology.from_world(dist.get_world_size(), dist.get_rank(), config["pp"], None)
    groups = topo.process_groups()
    replicas, stages = topo.data_parallel_size, topo.pipeline_parallel_size
    torch.manual_seed(0)
    model = TinyLM()
    idx, y = (t.chunk(replicas)[topo.dp_rank] for t in batch())  # this replica's rows
    xs, ys = idx.split(MICRO_BATCH), y.split(MICRO_BATCH)
    _, output_spec = tree_flatten(model(xs[0]))
    stage = Stage(model, config["boundaries"], topo, output_spec, torch.device("cpu"), groups.messages)
    graph, stage_module = stage.stage_for((xs[0],), {})
    stage.release_other_stages(graph, stage_module)
    stage.shared = SharedParameters(graph.stage_parameters, topo, dict(model.named_parameters()))
    actions = SCHEDULES[config["schedule"]](stages, len(xs))[topo.pp_rank]

    loss = None
    if config["engine"] == "runtime":

        def run_forward(m: int) -> torch.Tensor | None:
            graph, stage_module = stage.stage_for((xs[m],), {})
            return stage.runtime.forward(m, graph, stage_module, [xs[m]], True)

        def loss_of(m: int, logits: torch.Tensor | None) -> torch.Tensor | None:
            if logits is None:
                return None
            return F.cross_entropy(logits.flatten(0, 1), ys[m].flatten()) / (len(xs) * replicas)

        outputs = stage.runtime.run(actions, run_forward, loss_of)
        if topo.is_last_stage:
            loss = torch.stack([F.cross_entropy(o.flatten(0, 1), t.flatten()) for o, t in zip(outputs, ys)]).mean()
    else:  # the user's training_step per micro-batch, through the step engine
        step = MicroBatchedStep(model, stage, "training_step", (0,), {}, loss_weight=1 / replicas)
        loss = step.run((idx, y), MICRO_BATCH, actions, training=True, on_wait=lambda: None)

    params = stage.own_parameters()
    grads = reduce_gradients(params, [p.grad for p in params], groups.replicas, replicas, stage.shared)
    for p, grad in zip(params, grads):
        p.grad = grad
    norm = clip_grad_norm_across_stages(
        params, stage.shared.counted_once(params), config["clip"], groups.stages, stages
    )
    result = {
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "norm": norm,
        "loss": loss.detach() if loss is not None else None,
        "pp_rank": topo.pp_rank,
    }
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
