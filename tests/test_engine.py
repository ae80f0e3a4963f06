"""The pipeline's engine without a Trainer: a stage's runtime under each schedule, the step engine, the sums over
replicas and tied weights, clipping by the norm over all stages and the replicas' buffers, in one real gloo job of 4
processes (tests/run_engine.py), each compared with plain autograd in one process on the same model and rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_ranks
from models import TinyLM
from run_engine import BATCH, CLIP, MICRO_BATCH, batch
from torch import Tensor

from lightning_varuna.pipeline.gradients import clip_grad_norm_across_stages, sum_gradients

RUNNER = os.path.join(os.path.dirname(__file__), "run_engine.py")
WORLD = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
pytestmark = pytest.mark.xdist_group("engine")  # on one xdist worker, which then runs the module's job once


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the engine job's results (one job for the whole module: its start-up is most of its time)."""
    out = tmp_path_factory.mktemp("engine")
    proc = run_ranks([RUNNER, str(out)], WORLD, out, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def ranks(job: Path, layout: str) -> list[dict]:
    """What each rank of ``layout`` wrote, replica by replica and in stage order."""
    results = [torch.load(job / f"{layout}-rank{rank}.pt") for rank in range(WORLD)]
    return sorted(results, key=lambda r: (r.get("dp_rank", 0), r["pp_rank"]))


def reference(idx: Tensor, y: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """One process, the rows at once: the mean loss, the logits and the gradients by name."""
    torch.manual_seed(0)
    model = TinyLM()
    logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def microbatch_losses(idx: Tensor, y: Tensor) -> Tensor:
    """One process, one forward per micro-batch: each micro-batch's loss."""
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        return torch.stack(
            [
                F.cross_entropy(model(i).flatten(0, 1), t.flatten())
                for i, t in zip(idx.split(MICRO_BATCH), y.split(MICRO_BATCH))
            ]
        )


def assert_grads(got: dict[str, Tensor], expected: dict[str, Tensor], where: str) -> None:
    assert got, f"{where}: no gradients"
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], **TOLERANCE, msg=lambda m, n=name: f"{where}, {n}: {m}")


def test_one_replica_sums_nothing():
    """With one replica the gradients are returned as they are, without a collective (no process group here)."""
    grads = [torch.randn(3), torch.randn(2, 2)]
    assert sum_gradients(grads, None, 1) is grads
    assert sum_gradients([], None, 4) == []


def test_one_stage_clips_as_torch_does():
    """On one stage the norm over all stages is the stage's own, and the gradients are clipped as
    torch.nn.utils.clip_grad_norm_ clips them (no collective)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, copies):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.5)
    assert expected > 0.5  # clipping changes the gradients
    torch.testing.assert_close(clip_grad_norm_across_stages(params, params, 0.5, None, 1), expected)
    for p, q in zip(params, copies):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "varuna", "zero-bubble"])
def test_runtime_on_four_stages_computes_the_gradients_of_one_process(job, schedule):
    """StageRuntime at 4 stages x 1 replica, 8 micro-batches each weighted 1/8: each stage's gradients are one
    process's on the whole batch; the tied embedding / head's parts on stages 0 and 3 add up to its gradient, and
    `reduce_gradients` gives both stages that sum; the last stage's outputs and losses are one process's."""
    idx, y = batch()
    loss, logits, grads = reference(idx, y)
    results = ranks(job, "four")
    assert [r["rank"] for r in results] == [3, 2, 1, 0]  # rank 0 holds the last stage
    shared = set(results[0]["shared"])
    assert shared == {"emb.weight"} and results[-1]["shared"] == ["emb.weight"]
    assert not results[1]["shared"] and not results[2]["shared"]
    assert set().union(*(r["names"] for r in results)) == set(grads)
    for rank, result in enumerate(results):
        run = result[schedule]
        assert set(run["grads"]) == set(result["names"]), f"rank {rank}: a parameter got no gradient"
        assert_grads({n: g for n, g in run["grads"].items() if n not in shared}, grads, f"stage {rank}")
        assert_grads(run["reduced"], grads, f"stage {rank} after reduce_gradients")
    tied = results[0][schedule]["grads"]["emb.weight"] + results[-1][schedule]["grads"]["emb.weight"]
    torch.testing.assert_close(tied, grads["emb.weight"], **TOLERANCE)
    for rank in range(WORLD - 1):
        assert all(output is None for output in results[rank][schedule]["outputs"])
    outputs = results[-1][schedule]["outputs"]
    assert len(outputs) == BATCH // MICRO_BATCH
    torch.testing.assert_close(torch.cat(outputs), logits, **TOLERANCE)
    losses = torch.stack([F.cross_entropy(o.flatten(0, 1), t.flatten()) for o, t in zip(outputs, y.split(MICRO_BATCH))])
    torch.testing.assert_close(losses, microbatch_losses(idx, y), **TOLERANCE)
    torch.testing.assert_close(losses.mean(), loss, **TOLERANCE)


@pytest.mark.slow
def test_forward_only_gives_the_outputs_of_one_process_and_no_gradients(job):
    idx, y = batch()
    _, logits, _ = reference(idx, y)
    results = ranks(job, "four")
    torch.testing.assert_close(torch.cat(results[-1]["forward_only"]), logits, **TOLERANCE)
    for result in results:
        assert not result["grads_after_forward_only"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_runtime_of_each_replica_computes_its_rows_gradients(job, schedule):
    """StageRuntime at 2 stages in each of 2 replicas, before any sum: each replica's stage gradients are one
    process's on that replica's half of the batch, weighted 1/2 (each micro-batch's loss by 1/(2 x 4))."""
    results = ranks(job, "replicas")
    assert [(r["rank"], r["pp_rank"], r["dp_rank"]) for r in results] == [(1, 0, 0), (0, 1, 0), (3, 0, 1), (2, 1, 1)]
    halves = list(zip(*(t.chunk(2) for t in batch())))
    for rank, result in enumerate(results):
        idx, y = halves[result["dp_rank"]]
        _, logits, grads = reference(idx, y)
        half = {name: grad / 2 for name, grad in grads.items() if name not in result["shared"]}
        run = result[schedule]
        assert_grads({n: g for n, g in run["grads"].items() if n in half}, half, f"rank {rank}")
        if result["pp_rank"] == 1:
            torch.testing.assert_close(torch.cat(run["outputs"]), logits, **TOLERANCE)


@pytest.mark.slow
def test_reduce_gradients_sums_replicas_and_tied_weights(job):
    """After `reduce_gradients` at 2 stages x 2 replicas every rank holds one process's gradients on the whole
    batch, the tied embedding / head's included on both stages that hold it."""
    _, _, grads = reference(*batch())
    results = ranks(job, "replicas")
    assert all(r["shared"] == ["emb.weight"] for r in results)
    assert set().union(*(r["names"] for r in results)) == set(grads)
    for rank, result in enumerate(results):
        assert set(result["reduced"]) == set(result["names"])
        assert_grads(result["reduced"], grads, f"rank {rank}")


@pytest.mark.slow
def test_clip_grad_norm_across_stages_is_one_process_clipping(job):
    """`clip_grad_norm_across_stages` over 2 stages (the tied weight counted once): the norm and the clipped
    gradients are torch.nn.utils.clip_grad_norm_'s in one process."""
    torch.manual_seed(0)
    model = TinyLM()
    idx, y = batch()
    F.cross_entropy(model(idx).flatten(0, 1), y.flatten()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    assert norm > CLIP  # clipping changes the gradients
    clipped = {name: p.grad for name, p in model.named_parameters()}
    for rank, result in enumerate(ranks(job, "replicas")):
        torch.testing.assert_close(result["norm"], norm, **TOLERANCE, msg=lambda m, r=rank: f"rank {r}: {m}")
        assert_grads(result["clipped"], clipped, f"rank {rank}")


@pytest.mark.slow
def test_broadcast_buffers_gives_every_replica_the_first_ones(job):
    for rank, result in enumerate(ranks(job, "replicas")):
        src = 1 - result["pp_rank"]  # replica 0's rank of this stage
        expected = [torch.full((3,), float(src)), torch.arange(4.0) * (src + 1)]
        for got, want in zip(result["buffers"], expected):
            torch.testing.assert_close(got, want, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.slow
def test_micro_batched_step_computes_one_process_loss_and_gradients(job):
    """`MicroBatchedStep` running TinyLM's own ``training_step`` (its ``self.log`` captured, no Trainer) under
    Varuna's schedule (stage 0 recomputes) at 2 stages x 2 replicas: the last stage's merged loss and logged
    ``train_loss`` are one process's on the replica's rows, each replica's gradients half of that process's, and
    after `reduce_gradients` one process's on the whole batch."""
    _, _, grads = reference(*batch())
    halves = list(zip(*(t.chunk(2) for t in batch())))
    for rank, result in enumerate(ranks(job, "replicas")):
        step = result["step"]
        loss, _, half_grads = reference(*halves[result["dp_rank"]])
        half = {name: grad / 2 for name, grad in half_grads.items() if name not in result["shared"]}
        assert_grads({n: g for n, g in step["grads"].items() if n in half}, half, f"rank {rank}")
        assert_grads(step["reduced"], grads, f"rank {rank} after reduce_gradients")
        if result["pp_rank"] == 1:
            torch.testing.assert_close(step["loss"], loss, **TOLERANCE)
            assert step["logged"]["train_loss"] == pytest.approx(loss.item(), rel=1e-5)
        else:
            assert step["loss"] is None
