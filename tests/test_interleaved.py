"""The interleaved 1F1B schedule (several stages per rank, round-robin) trains the same model as one device (real
processes, gloo), and what it cannot run is refused before training."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from models import TinyLM, token_dataset
from test_parity import assert_matches_single_device, run_pipelined

from lightning_varuna import VarunaStrategy
from lightning_varuna.pipeline.schedules import interleaved_one_f_one_b
from lightning_varuna.profiling.profile import LinearCost
from lightning_varuna.profiling.profiler import profile_model

pytestmark = pytest.mark.slow  # real multi-process jobs

INTERLEAVED = dict(schedule="interleaved-1f1b", epochs=2)

SHAPES = {
    # 4 stages on 2 ranks (the tied embedding on stage 0, global rank 1, the head on stage 3, global rank 0; and the
    # mask stage 0 makes is read by every stage, so stage 0 sends it to stage 2 on its own rank); micro-batches
    # [2, 2, 2], clipping by the global norm, validation and predictions (forwards only, every stage of a rank in
    # turn), and a PipelineTrace of steps 1 and 2
    "P2xD1-V2-clip": dict(
        pipeline_parallel_size=2,
        data_parallel_size=1,
        batch_size=6,
        micro_batch_size=2,
        clip=0.05,
        evaluate=True,
        trace="step1.json",
    ),
    # replicas and gradient accumulation; micro-batches [1] * 4 in torch's rounds of 2
    "P2xD2-V2-accumulate": dict(
        pipeline_parallel_size=2, data_parallel_size=2, batch_size=4, micro_batch_size=1, accumulate=2, clip=0.05
    ),
    # 6 stages on 2 ranks (6 blocks, 5 CutPoints); micro-batches [2, 2, 1]
    "P2xD1-V3": dict(
        pipeline_parallel_size=2, data_parallel_size=1, batch_size=5, micro_batch_size=2, stages_per_rank=3, blocks=6
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_interleaved_training_matches_single_device(tmp_path, name):
    config = {**INTERLEAVED, **SHAPES[name]}
    trains_like_one_device(tmp_path, config)
    if "trace" in config:
        assert_trace_shows_virtual_stages(json.loads((tmp_path / "step1.json").read_text()), config)


def trains_like_one_device(tmp_path, config: dict) -> dict:
    """Train ``config`` (3 batches an epoch; its ``trace`` file under ``tmp_path``) pipelined in real processes, assert
    it ran its schedule and matches one device; its result."""
    config = {**config, "rows": config["batch_size"] * config["data_parallel_size"] * 3}
    if "trace" in config:
        config["trace"] = str(tmp_path / config["trace"])
    result, shards = run_pipelined(tmp_path, config)
    assert result["schedule"] == config["schedule"]
    assert_matches_single_device(result, shards, config)
    return result


def assert_trace_shows_virtual_stages(trace: dict, config: dict) -> None:
    """A thread per pipeline rank named with its stages; each of its actions in the schedule's order, named and
    tagged with its stage, then the all-reduce and the optimizer step."""
    P, V = config["pipeline_parallel_size"], config.get("stages_per_rank", 2)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0: "stages 0, 2", 1: "stages 1, 3"}
    title = trace["traceEvents"][0]["args"]["name"]
    assert "P=2 D=1 " in title and "interleaved-1f1b V=2" in title
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["step"] == 1]
    schedule = interleaved_one_f_one_b(P, config["batch_size"] // config["micro_batch_size"], V)
    for rank, actions in enumerate(schedule):
        mine = sorted((e for e in events if e["tid"] == rank), key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == [*map(str, actions), "all-reduce", "optimizer"]
        assert [e["args"].get("stage") for e in mine[: len(actions)]] == [a.stage for a in actions]


def uniform_profile(path: str) -> None:
    """A profile of the 4-segment TinyLM at ``path`` whose segments cost the same (a forward twice a backward) and
    whose messages are free: AutoConfig predicts interleaving 2 stages per rank fastest at 2 processes."""
    torch.manual_seed(0)
    profile = profile_model(
        TinyLM(blocks=4),
        (token_dataset(2).tensors[0],),
        micro_batch_sizes=[1, 2],
        thread_counts=[1],
        repeats=1,
        progress=False,
    )
    for segment in profile.segments:
        for rows, timing in segment.timings[1].items():
            segment.timings[1][rows] = replace(
                timing, forward_s=2e-3 * rows, forward_no_grad_s=1e-3 * rows, backward_s=1e-3 * rows
            )
    profile.cores_per_node, profile.p2p = 2, {2: LinearCost(0.0, 1e18)}
    profile.allreduce = {2: {2: LinearCost(1e-4, 1e12)}}
    profile.save(path)


def test_auto_schedule_chooses_interleaving_and_trains_like_one_device(tmp_path):
    """`schedule="auto"` at 2 processes picks interleaved 1F1B where the profile predicts it fastest, lays out the V
    it chose, and trains exactly like one device."""
    uniform_profile(str(tmp_path / "uniform.json"))
    config = dict(
        pipeline_parallel_size=2,
        data_parallel_size=1,
        micro_batch_size="auto",
        schedule="auto",
        profile=str(tmp_path / "uniform.json"),
        global_batch_size=4,
        batch_size=4,
        rows=12,
        epochs=2,
        blocks=4,
    )
    result, shards = run_pipelined(tmp_path, config)
    assert (result["schedule"], result["stages_per_rank"], result["shape"]) == ("interleaved-1f1b", 2, [2, 1, 1])
    assert_matches_single_device(result, shards, config)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(schedule="varuna", stages_per_rank=2), r"stages_per_rank=2\)` needs an interleaved schedule"),
        (dict(schedule="interleaved-1f1b", stages_per_rank=1), r"interleaves 2 or more stages per rank"),
        (dict(schedule="interleaved-1f1b", pipeline_parallel_size=1), r"with `pipeline_parallel_size=1`"),
    ],
)
def test_what_interleaving_cannot_run_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        VarunaStrategy(**{"pipeline_parallel_size": 2, "global_batch_size": 8, **options})
