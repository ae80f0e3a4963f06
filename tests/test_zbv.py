"""The ZBV schedule (two stages per rank in a V, zero-bubble) trains the same model as one device (real processes,
gloo), in torch's order, and what it cannot run is refused before training."""

from __future__ import annotations

import json

import pytest
from test_interleaved import SHAPES as INTERLEAVED_SHAPES
from test_interleaved import trains_like_one_device
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

from lightning_varuna import VarunaStrategy
from lightning_varuna.pipeline.schedules import Phase, dry_run, zbv
from lightning_varuna.pipeline.topology import Topology

ZBV = dict(schedule="zbv", epochs=2)

SHAPES = {
    # The interleaved tests' shapes of 4 stages on 2 ranks, in a V: rank 0 (position 0) holds stages 0 and 3, the tied
    # embedding and head, which then need no cross-rank sum. Micro-batches [2, 2, 2], clipping by the global norm,
    # validation and predictions (forwards only, down the V), and a PipelineTrace of steps 1 and 2:
    "P2xD1-clip": INTERLEAVED_SHAPES["P2xD1-V2-clip"],
    # replicas and gradient accumulation; micro-batches [1] * 4
    "P2xD2-accumulate": INTERLEAVED_SHAPES["P2xD2-V2-accumulate"],
    # 6 stages on 3 ranks (6 blocks, 5 CutPoints); micro-batches [2, 2, 1], fewer than the V's 2P - 1 = 5
    "P3xD1": dict(pipeline_parallel_size=3, data_parallel_size=1, batch_size=5, micro_batch_size=2, blocks=6),
}


@pytest.mark.slow  # real multi-process jobs
@pytest.mark.parametrize("name", list(SHAPES))
def test_zbv_training_matches_single_device(tmp_path, name):
    config = {**ZBV, **SHAPES[name]}
    result = trains_like_one_device(tmp_path, config)
    assert (result["schedule"], result["stages_per_rank"]) == ("zbv", 2)
    if "trace" in config:
        assert_trace_shows_the_v(json.loads((tmp_path / "step1.json").read_text()), config)


def assert_trace_shows_the_v(trace: dict, config: dict) -> None:
    """A thread per pipeline rank named with its stages in a V; each of its actions in the schedule's order, the
    input-gradient (B) and weight (W) parts of each backward as separate slices."""
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0: "stages 0, 3", 1: "stages 1, 2"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["step"] == 1]
    for rank, actions in enumerate(zbv(2, config["batch_size"] // config["micro_batch_size"])):
        mine = sorted((e for e in events if e["tid"] == rank), key=lambda e: e["ts"])
        assert [e["name"] for e in mine[: len(actions)]] == list(map(str, actions))
        assert any(e["name"].startswith(f"{actions[0].stage}W") for e in mine)


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
def test_zbv_order_is_torch_and_passes_the_dry_run(P, M):
    """Action for action torch's `ScheduleZBVZeroBubble` order (its idle slots left out), every stage's forward,
    input-gradient and weight part of each micro-batch once, and no deadlock."""
    torch_schedule = ScheduleZBVZeroBubble.__new__(ScheduleZBVZeroBubble)  # its order alone, without stages
    torch_schedule.pp_group_size, torch_schedule.num_stages, torch_schedule._n_microbatches = P, 2 * P, M
    letter = {
        _ComputationType.FORWARD: "F",
        _ComputationType.BACKWARD_INPUT: "B",
        _ComputationType.BACKWARD_WEIGHT: "W",
    }
    ours = zbv(P, M)
    for rank in range(P):
        theirs = torch_schedule._calculate_single_rank_operations(rank)
        expected = [f"{a.stage_index}{letter[a.computation_type]}{a.microbatch_index}" for a in theirs if a]
        assert list(map(str, ours[rank])) == expected
        assert {a.stage for a in ours[rank]} == {rank, 2 * P - 1 - rank}
        assert sum(a.phase is Phase.WEIGHT for a in ours[rank]) == 2 * M
    dry_run(ours)


def test_a_v_puts_the_first_and_last_stage_on_rank_zero():
    """In a V, global rank 0 holds stages 0 and 2P - 1 (the loss and the rank-zero code on one rank, as with the other
    schedules), each position p stages p and 2P - 1 - p, and each replica the same."""
    layout = [Topology(3, 2, rank, 2, v_shape=True) for rank in range(6)]
    assert [t.stage_indices for t in layout] == [(0, 5), (1, 4), (2, 3)] * 2
    assert [t.is_last_stage for t in layout] == [True, False, False] * 2
    assert layout[4].ranks_of_stages() == [3, 4, 5, 5, 4, 3]
    assert layout[4].stage_ranks() == [3, 4, 5]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(schedule="zbv", stages_per_rank=3), r"places exactly 2 stages per rank, in a V"),
        (dict(schedule="zbv", pipeline_parallel_size=1), r"with `pipeline_parallel_size=1`"),
    ],
)
def test_what_zbv_cannot_run_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        VarunaStrategy(**options)
