"""A pipelined, data-parallel run trains the same model as single-device training (real processes, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import clean_env, run_job, run_ranks
from models import TinyLM, token_dataset
from ports import free_port
from reference import train_reference

from lightning_varuna.data.microbatch import default_micro_batch_size
from lightning_varuna.profiling.profiler import profile_model

pytestmark = pytest.mark.slow  # real multi-process jobs

RUNNER = os.path.join(os.path.dirname(__file__), "run_pipelined.py")

SHAPES = {
    # (P, D): micro-batches [2, 2, 2], gradient clipping by the global norm
    "P2xD1-1f1b-clip": dict(
        pipeline_parallel_size=2,
        data_parallel_size=1,
        batch_size=6,
        micro_batch_size=2,
        schedule="1f1b",
        clip=0.05,
        evaluate=True,
    ),
    # micro-batches [2, 2, 1], gradient accumulation without replicas (gradients scaled, not all-reduced)
    "P3xD1-1f1b-accumulate": dict(
        pipeline_parallel_size=3, data_parallel_size=1, batch_size=5, micro_batch_size=2, schedule="1f1b", accumulate=2
    ),
    # micro-batches [4, 2], gradient accumulation
    "P1xD2-gpipe-accumulate": dict(
        pipeline_parallel_size=1, data_parallel_size=2, batch_size=6, micro_batch_size=4, schedule="gpipe", accumulate=2
    ),
    # micro-batches [4, 2], clipping and an LR scheduler
    "P2xD2-1f1b-scheduler": dict(
        pipeline_parallel_size=2,
        data_parallel_size=2,
        batch_size=6,
        micro_batch_size=4,
        schedule="1f1b",
        clip=0.05,
        scheduler=True,
        evaluate=True,
    ),
    # the default micro-batch size: 4 micro-batches per stage, here [1] * 4
    "P4xD1-varuna": dict(pipeline_parallel_size=4, data_parallel_size=1, batch_size=4, schedule="varuna"),
    # Varuna's recompute schedule with replicas; micro-batches [2, 2, 1]
    "P2xD2-varuna": dict(
        pipeline_parallel_size=2, data_parallel_size=2, batch_size=5, micro_batch_size=2, schedule="varuna"
    ),
    # a forward that reads a buffer it changes, recomputed by the varuna schedule; one micro-batch a step (a count of
    # forward calls is then one device's)
    "P2xD1-varuna-counting": dict(
        pipeline_parallel_size=2,
        data_parallel_size=1,
        batch_size=4,
        micro_batch_size=4,
        schedule="varuna",
        counting=True,
    ),
    # zero-bubble (the weight passes deferred) with replicas, clipping and accumulation; micro-batches [2, 2, 1]
    "P2xD2-zero-bubble-clip-accumulate": dict(
        pipeline_parallel_size=2,
        data_parallel_size=2,
        batch_size=5,
        micro_batch_size=2,
        schedule="zero-bubble",
        clip=0.05,
        accumulate=2,
    ),
    # zero-bubble on 4 stages (the tied embedding and head on the first and last); micro-batches [1] * 4
    "P4xD1-zero-bubble": dict(pipeline_parallel_size=4, data_parallel_size=1, batch_size=4, schedule="zero-bubble"),
    # 5 segments over 3 stages; micro-batches [2, 2, 1]
    "P3xD1-gpipe-uneven": dict(
        pipeline_parallel_size=3, data_parallel_size=1, batch_size=5, micro_batch_size=2, schedule="gpipe"
    ),
}


def run_pipelined(tmp_path, config: dict) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    out = tmp_path / "out"
    per_node = devices_per_node(config)
    args = [RUNNER, str(out), json.dumps(config)]
    if config.get("accelerator") == "gpu":  # Lightning starts the ranks: a fork would inherit CUDA's driver state
        proc = run_job(args, tmp_path, env={"PYTHONUNBUFFERED": "1"})
    else:
        proc = run_ranks(args, per_node * config.get("num_nodes", 1), tmp_path, per_node)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return outputs(out, config)


def devices_per_node(config: dict) -> int:
    return config.get("devices") or config["pipeline_parallel_size"] * config["data_parallel_size"]


def outputs(out: Path, config: dict) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """What run_pipelined.py wrote to ``out``: rank 0's results and every rank's parameters."""
    world = devices_per_node(config) * config.get("num_nodes", 1)
    shards = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return json.loads((out / "losses.json").read_text()), shards


def parity_config(name: str) -> dict:
    """The shape ``name`` trained for 2 epochs of 3 steps."""
    config = {**SHAPES[name], "epochs": 2}
    config["rows"] = config["batch_size"] * config["data_parallel_size"] * 3
    return config


@pytest.mark.parametrize("name", list(SHAPES))
def test_pipelined_training_matches_single_device(tmp_path, name):
    config = parity_config(name)
    result, shards = run_pipelined(tmp_path, config)
    if "micro_batch_size" not in config:
        assert result["shape"][2] == default_micro_batch_size(config["batch_size"], config["pipeline_parallel_size"])
    assert_matches_single_device(result, shards, config)


def test_a_step_that_sets_should_stop_stops_every_stage_where_one_device_stops(tmp_path):
    """``self.trainer.should_stop = True`` in ``training_step``, which runs on the last stage (after the forward, as
    a stop decided on the loss is set), stops every stage after that step, as one device stops: the other stages
    trained on, waiting for a last stage that had stopped."""
    config = {**parity_config("P2xD1-1f1b-clip"), "stop_at_step": 4}
    result, shards = run_pipelined(tmp_path, config)
    ref, ref_weights = train_reference(config)
    assert len(result["losses"]) == len(ref["losses"]) == 4
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for rank, shard in enumerate(shards):
        for name, value in shard.items():
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-4, atol=1e-5, msg=f"{name} on rank {rank}")


def test_a_learning_rate_set_at_the_epoch_end_applies_to_every_stage_as_on_one_device(tmp_path):
    """``on_train_epoch_end`` runs on the last stage only; the learning rate it sets by hand and the scheduler it
    steps by hand hold on every stage for the next epoch, as on one device (stage 0 trained on at the old rate)."""
    config = {**parity_config("P2xD2-1f1b-scheduler"), "lr_at_epoch_end": True}
    result, shards = run_pipelined(tmp_path, config)
    assert_matches_single_device(result, shards, config)


STARTED_BY_MULTIPROCESSING = """
import lightning as L
import torch
from torch.utils.data import DataLoader
from models import model_for, token_dataset
from lightning_varuna import VarunaStrategy

config, out = {config!r}, {out!r}
L.seed_everything(0)
model = model_for(config)
strategy = VarunaStrategy(micro_batch_size=config["micro_batch_size"], start_method={method!r})
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=config["epochs"], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(token_dataset(config["rows"]), batch_size=config["batch_size"]))
torch.save(dict(model.named_parameters()), out)  # rank 0's weights, which the launcher hands back
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_replicas_started_by_multiprocessing_train_like_one_device(tmp_path, start_method):
    """Ranks that Lightning's launcher starts from the script's process, the model sent to each: 2 replicas train the
    same model as one device, under "forkserver" too, where the model arrives in memory that every rank shares (and
    both replicas stepped the one copy)."""
    config = dict(pipeline_parallel_size=1, data_parallel_size=2, batch_size=3, micro_batch_size=3, epochs=2)
    config.update(rows=3 * 2 * 3, schedule="gpipe")
    out = tmp_path / "weights.pt"
    code = STARTED_BY_MULTIPROCESSING.format(config=config, out=str(out), method=start_method)
    env = {**clean_env(), "PYTHONPATH": os.path.dirname(__file__), "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _, reference = train_reference(config)
    for name, value in torch.load(out).items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=name)


def test_srun_job_trains_like_one_device(tmp_path, slurm):
    """Started by ``srun`` in a SLURM batch job (one task per rank, as Lightning runs under SLURM), a (2, 2) run
    trains the same model as one device."""
    config = parity_config("P2xD2-1f1b-scheduler")
    command = f"srun {sys.executable} {RUNNER} {tmp_path / 'out'} '{json.dumps(config)}'"
    job = slurm.sbatch(command, "--job-name=parity", "--ntasks-per-node=4", cwd=tmp_path, env=clean_env())
    state = slurm.wait_until_ended(job, 300)
    output = slurm.output(job, tmp_path)
    assert state == "COMPLETED", output[-6000:]
    assert "Initializing distributed: GLOBAL_RANK: 3, MEMBER: 4/4" in output
    result, shards = outputs(tmp_path / "out", config)
    assert result["shape"][:2] == [2, 2]
    assert_matches_single_device(result, shards, config)


def test_two_nodes_started_by_lightning_train_like_one_device(tmp_path):
    """``num_nodes=2``: the same script starts on each node with its ``NODE_RANK`` (both nodes on loopback here)
    and Lightning starts each node's processes; the 4 stages of the pipeline span both nodes."""
    config = {**parity_config("P4xD1-varuna"), "devices": 2, "num_nodes": 2}
    out = tmp_path / "out"
    env = {**clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, RUNNER, str(out), json.dumps(config)]
    nodes = [
        subprocess.Popen(command, env={**env, "NODE_RANK": str(node)}, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
        for node in range(2)
    ]
    errors = [node.communicate(timeout=600)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-4000:] + errors[1][-4000:]
    result, shards = outputs(out, config)
    assert result["shape"][:2] == [4, 1]
    assert_matches_single_device(result, shards, config)


def assert_matches_single_device(result: dict, shards: list[dict[str, torch.Tensor]], config: dict) -> None:
    """Losses, metrics, evaluation and every rank's weights equal single-device training on the same batches."""
    ref, ref_weights = train_reference(config)

    assert len(result["losses"]) == len(ref["losses"]) == 6
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    assert result["acc"] == pytest.approx(ref["acc"], abs=1e-6)
    if config.get("evaluate"):
        assert result["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
        assert result["val_f1"] == pytest.approx(ref["val_f1"], rel=1e-5)
        if "predictions" in result:
            assert result["predictions"] == ref["predictions"]
    seen = set()
    for rank, shard in enumerate(shards):
        for name_, value in shard.items():
            # Every copy (replicas, tied-weight copies on two stages) equals the single-device weight.
            torch.testing.assert_close(value, ref_weights[name_], rtol=1e-4, atol=1e-5, msg=f"{name_} on rank {rank}")
            seen.add(name_)
    assert seen == set(ref_weights)
    if config["pipeline_parallel_size"] > 1:
        # Each rank holds only its own stage.
        assert all(len(shard) < len(ref_weights) for shard in shards)


def test_varuna_schedule_replays_dropout_on_recompute(tmp_path):
    """With dropout on, recomputing the forward draws the same masks: varuna trains exactly like 1F1B."""
    config = dict(
        pipeline_parallel_size=3, data_parallel_size=1, batch_size=5, micro_batch_size=2, dropout=0.3, epochs=1
    )
    config["rows"] = 15
    # Each stage draws its own dropout masks: both runs must cut the model in the same place, so they balance the
    # stages with one profile instead of timing the segments at start-up (which a busy machine can change).
    profile = profile_model(TinyLM(), (token_dataset(4).tensors[0],), micro_batch_sizes=[2], progress=False)
    profile.save(str(tmp_path / "profile.json"))
    config["profile"] = str(tmp_path / "profile.json")
    runs = {}
    for schedule in ("1f1b", "varuna"):
        (tmp_path / schedule).mkdir()
        runs[schedule] = run_pipelined(tmp_path / schedule, {**config, "schedule": schedule})
    (losses, shards), (varuna_losses, varuna_shards) = runs["1f1b"], runs["varuna"]
    torch.testing.assert_close(
        torch.tensor(varuna_losses["losses"]), torch.tensor(losses["losses"]), rtol=1e-6, atol=1e-6
    )
    for shard, varuna_shard in zip(shards, varuna_shards):
        torch.testing.assert_close(varuna_shard, shard, rtol=1e-6, atol=1e-6)
    # Dropout did act: the same training without it gives other losses.
    without, _ = train_reference({**config, "dropout": 0.0, "schedule": "1f1b"})
    assert max(abs(a - b) for a, b in zip(losses["losses"], without["losses"])) > 1e-3


BF16 = dict(pipeline_parallel_size=2, data_parallel_size=1, batch_size=6, micro_batch_size=3, epochs=1, rows=18)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "interleaved-1f1b", "zbv"])
def test_bf16_autocast_pipeline_tracks_single_device(tmp_path, schedule):
    bf16_tracks_single_device(tmp_path, dict(BF16, schedule=schedule, precision="bf16-mixed"))


def bf16_tracks_single_device(tmp_path, config: dict) -> None:
    result, _ = run_pipelined(tmp_path, config)
    ref, _ = train_reference(config)
    # bf16 rounds differently on micro-batches than on the whole batch: equal to bf16 precision.
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)
    assert result["losses"][-1] < result["losses"][0]


# fp16 autocast with a CPU GradScaler whose first scales overflow the gradients.
FP16 = dict(batch_size=6, micro_batch_size=3, schedule="1f1b", fp16_init_scale=2.0**20, epochs=2)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_fp16_loss_scaling_skips_the_same_steps_as_single_device(tmp_path, schedule):
    """fp16 autocast with a GradScaler (Lightning's CUDA AMP path, here on CPU): the first scales overflow the
    gradients of the last stage, and every stage skips those steps and backs off the scale together, exactly as one
    device does on the same batches (zero-bubble: with the weight passes deferred)."""
    fp16_skips_like_single_device(
        tmp_path, dict(FP16, pipeline_parallel_size=2, data_parallel_size=1, rows=36, schedule=schedule)
    )


def fp16_skips_like_single_device(tmp_path, config: dict) -> None:
    result, shards = run_pipelined(tmp_path, config)
    ref, ref_weights = train_reference(config)

    assert ref["loss_scales"][-1] < config["fp16_init_scale"] / 8  # several steps overflowed and were skipped
    assert result["loss_scales"] == ref["loss_scales"]
    # fp16 rounds differently on micro-batches than on the whole batch: equal to fp16 precision.
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=1e-2)
    assert result["losses"][-1] < result["losses"][0]
    for rank, shard in enumerate(shards):
        for name, value in shard.items():
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-2, atol=1e-3, msg=f"{name} on rank {rank}")


def test_fp16_a_stage_of_frozen_parameters_skips_overflowing_steps_with_the_others(tmp_path):
    """The first stage's parameters are all frozen (in AdamW, as `self.parameters()` gives them): it holds no
    gradient, and its grad scaler still skips the steps that overflowed on the last stage and backs off with it
    (torch's GradScaler refuses a step with no gradients to check), while the frozen weights stay as they were."""
    frozen = ["emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]  # the tied head too: stage 0 has only these
    config = dict(FP16, pipeline_parallel_size=2, data_parallel_size=1, rows=36, frozen=frozen)
    result, shards = run_pipelined(tmp_path, config)
    ref, ref_weights = train_reference(config)

    assert ref["loss_scales"][-1] < config["fp16_init_scale"] / 8  # several steps overflowed and were skipped
    assert result["loss_scales"] == ref["loss_scales"]
    for rank, shard in enumerate(shards):
        for name, value in shard.items():
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-2, atol=1e-3, msg=f"{name} on rank {rank}")
            if name.startswith(("emb.", "blocks.0.")):
                assert torch.equal(value, ref_weights[name]), name  # frozen: untouched, as on one device


def test_fp16_replicas_skip_overflowing_steps_together(tmp_path):
    """With replicas, each sums its micro-batches' fp16 gradients before the all-reduce, so a step near the overflow
    threshold may overflow on one device and not here; but all stages and replicas skip alike and stay equal."""
    config = dict(FP16, pipeline_parallel_size=2, data_parallel_size=2, rows=72)
    result, shards = run_pipelined(tmp_path, config)
    ref, _ = train_reference(config)

    assert result["loss_scales"][0] == config["fp16_init_scale"] / 2  # the first step overflowed and was skipped
    assert result["losses"][-1] < result["losses"][0]
    torch.testing.assert_close(
        torch.tensor(result["losses"][:4]), torch.tensor(ref["losses"][:4]), rtol=1e-2, atol=1e-2
    )
    # Ranks 0 and 2 hold stage 0 of replicas 0 and 1, ranks 1 and 3 stage 1: a replica that stepped while the
    # other skipped would differ.
    for first, second in ((0, 2), (1, 3)):
        assert shards[first].keys() == shards[second].keys()
        for name in shards[first]:
            assert torch.equal(shards[first][name], shards[second][name]), name
