"""The simulator predicts a spilled step from the profile and the spilling package's own packing; AutoConfig ranks
spilled training with the pipeline shapes, within a memory budget per device."""

from __future__ import annotations

import pytest
import torch

from lightning_varuna.cli import main as cli
from lightning_varuna.partition.packing import pack_shards, smallest_budgets
from lightning_varuna.pipeline.schedules import SCHEDULES
from lightning_varuna.profiling.autoconfig import describe_choice, format_ranking, rank_configs
from lightning_varuna.profiling.profile import (
    LinearCost,
    ModelProfile,
    ProfiledSegment,
    RuntimeOverheads,
    SegmentTiming,
    SpillCosts,
)
from lightning_varuna.profiling.simulator import Prediction
from lightning_varuna.profiling.spilled import SpilledConfig, SpilledPrediction, segment_memory, simulate_spilled
from lightning_varuna.spilling.bandwidth import measure_spill_tiers

# The disk tier: 1000 bytes a second to read, 2000 to write, no latency (the hand-checked step below).
DISK = SpillCosts(read=LinearCost(0.0, 1000.0), write=LinearCost(0.0, 2000.0))
HOST = SpillCosts(read=LinearCost(0.0, 1e18), write=LinearCost(0.0, 1e18))


def profile_of(segments: int = 3) -> ModelProfile:
    """Segments of 1000 bytes of parameters (2000 of AdamW state) that take 0.25 s forward, 0.5 s backward per row
    and keep 250 bytes per row for backward, passing 10 bytes per row on; one thread; an optimizer step of 0.5 s."""

    def timing(rows: int, last: bool) -> SegmentTiming:
        return SegmentTiming(0.25 * rows, 0.1 * rows, 0.5 * rows, 250 * rows, 0 if last else 10 * rows)

    return ModelProfile(
        model="hand-checked",
        device="cpu",
        cores_per_node=1,
        segments=[
            ProfiledSegment(
                name=f"cut{i}",
                fingerprint=str(i),
                parameters={f"w{i}": 1000},
                optimizer_bytes=2000,
                optimizer_step_s={1: 0.5},
                timings={1: {mb: timing(mb, i == segments - 1) for mb in (1, 2, 4)}},
            )
            for i in range(segments)
        ],
        p2p={n: LinearCost(0.0, 1e18) for n in range(2, 5)},
        allreduce={n: {d: LinearCost(0.0, 1e18) for d in range(2, 5)} for n in range(2, 5)},
        spill={"host": HOST, "disk": DISK},
    )


def test_a_spilled_step_adds_up_from_a_hand_checked_profile():
    """Three shards of one segment (a budget of 10160 bytes: two neighbours fit, no room to keep activations), a
    batch of 4 rows: each segment needs 4000 bytes of state and 1000 of activations; 160 bytes of boundary values
    and their gradients stay. By hand, on the disk (params 1 s to read, 0.5 to write; state 2 s and 1 s):

    a step starts as the last one ended: writing shard 0's parameters and state (0-1.5);
    forward  read p0 (io 1.5-2.5), p1 (2.5-3.5); F0 2.5-3.5; read p2 (3.5-4.5), F1 3.5-4.5; F2 4.5-5.5
    backward read s2 (5.5-7.5), p1 (7.5-8.5), s1 (8.5-10.5); B2 7.5-9.5, step 9.5-10, write p2 s2 (10.5-12)
             read p0 (12-13), s0 (13-15); R1 10.5-11.5, B1 11.5-13.5, step 13.5-14, write p1 s1 (15-16.5)
             R0 15-16, B0 16-18, step 18-18.5, write p0 s0 (18.5-20: the next step's start)
    waits: 2.5 + 2 + 0.5 + 1 = 6 s, compute 12.5 s.
    """
    profile = profile_of()
    config = SpilledConfig(global_batch_size=4, memory_budget=10160, tier="disk")
    p = simulate_spilled(profile, config)
    assert p.shards == [[0], [1], [2]] and p.recomputed == [0, 1]
    assert (p.forward_s, p.recompute_s, p.backward_s, p.optimizer_s) == (3.0, 2.0, 6.0, 1.5)
    assert p.wait_s == pytest.approx(2.5 + 2.0 + 0.5 + 1.0)
    assert p.step_s == pytest.approx(18.5) == pytest.approx(p.compute_s + p.wait_s + p.overhead_s)
    assert (p.bytes_read, p.bytes_written) == (3 * 1000 + 2 * 1000 + 3 * 2000, 3 * (1000 + 2000))
    assert p.memory_bytes == [160 + 2 * 5000]  # what stays, and two neighbours together
    # In host memory on the CPU nothing moves: the step is its compute; calibrated per-step costs add on.
    host = simulate_spilled(profile, SpilledConfig(4, 10160, "host"))
    assert host.step_s == pytest.approx(12.5) and host.wait_s == pytest.approx(0.0)
    profile.overheads = {1: RuntimeOverheads(step_s=0.25, forward_per_row_s=0.125)}
    assert simulate_spilled(profile, SpilledConfig(4, 10160, "host")).step_s == pytest.approx(12.5 + 0.25 + 0.5)


def test_the_prediction_packs_as_spilling_strategy_does():
    """The shards, their neighbours fetched ahead and the recomputes are `pack_shards`' own for the budget (one shard
    where the model fits the budget whole, as the strategy runs it). More
    budget keeps more activations: in host memory the step gets no slower; on the disk, the smallest budget (no
    shard fetched ahead) is the slowest, but larger shards may be slower than small ones (their first fetch and last
    spill overlap nothing)."""
    profile = profile_of(segments=6)
    memory, kept = segment_memory(profile, 4)
    smallest, with_prefetch, _ = smallest_budgets(memory, kept)
    disk, host, recomputes = [], [], []
    for budget in (smallest, with_prefetch, 2 * with_prefetch, 4 * with_prefetch):
        p = simulate_spilled(profile, SpilledConfig(4, budget, "disk"))
        fits_whole = sum(segment.need for segment in memory) <= budget - kept  # one shard, nothing fetched beside
        packing = pack_shards(memory, budget, kept, prefetch=not fits_whole)
        assert p.shards == packing.shards and max(p.memory_bytes) <= budget
        assert p.recomputed == [k for k, keeps in enumerate(packing.keeps[:-1]) if not keeps]
        disk.append(p.step_s)
        host.append(simulate_spilled(profile, SpilledConfig(4, budget, "host")).step_s)
        recomputes.append(len(p.recomputed))
    assert recomputes == sorted(recomputes, reverse=True) and recomputes[-1] < recomputes[0]
    host = [round(t, 9) for t in host]
    assert host == sorted(host, reverse=True) and host[-1] < host[0]
    assert disk[0] == max(disk) > min(disk)
    with pytest.raises(ValueError, match=f"memory_budget={smallest}"):
        simulate_spilled(profile, SpilledConfig(4, smallest - 1, "disk"))


def test_a_budget_that_excludes_every_pipeline_shape_makes_autoconfig_choose_spilling():
    profile = profile_of(segments=8)
    pipelines = rank_configs(profile, 2, 4)
    smallest_pipeline = min(max(p.memory_bytes) for p in pipelines)
    memory, kept = segment_memory(profile, 4)
    _, with_prefetch, _ = smallest_budgets(memory, kept)
    assert with_prefetch < smallest_pipeline  # the budget between them trains spilled only
    ranked = rank_configs(profile, 2, 4, memory_bytes=smallest_pipeline - 1)
    assert ranked and all(isinstance(p, SpilledPrediction) for p in ranked)
    assert {p.config.tier for p in ranked} == {"host", "disk"}  # type: ignore[union-attr]
    assert ranked[0].config.tier == "host"  # type: ignore[union-attr]  # nothing to move on the CPU
    assert all(max(p.memory_bytes) <= smallest_pipeline - 1 for p in ranked)
    assert "chose spilled to host" in describe_choice(ranked) and "runner-up spilled to disk" in describe_choice(ranked)
    # A budget that fits some pipeline shapes ranks them with the spilled configurations, the others left out.
    both = rank_configs(profile, 2, 4, memory_bytes=smallest_pipeline)
    assert any(isinstance(p, Prediction) for p in both) and any(isinstance(p, SpilledPrediction) for p in both)
    assert all(max(p.memory_bytes) <= smallest_pipeline for p in both)
    # Below what trains it spilled too, nothing is ranked, and the error names the smallest budget.
    smallest, _, _ = smallest_budgets(memory, kept)
    with pytest.raises(ValueError, match=f"memory_budget={smallest}"):
        rank_configs(profile, 2, 4, memory_bytes=smallest - 1)


def test_a_model_that_fits_picks_no_spilling():
    profile = profile_of(segments=4)
    roomy = rank_configs(profile, 2, 4, memory_bytes=10**9)
    assert isinstance(roomy[0], Prediction)
    assert not any(isinstance(p, SpilledPrediction) for p in roomy)  # one shard: it would not be spilled
    # On one device, with a budget that fits it whole but not spilled's fewer shards' extra work:
    one_device = rank_configs(profile, 1, 4, memory_bytes=min(max(p.memory_bytes) for p in rank_configs(profile, 1, 4)))
    assert isinstance(one_device[0], Prediction)
    # A budget that fits the model whole but not in half of it: it stays whole on the device, as the strategy runs it.
    memory, kept = segment_memory(profile, 4)
    whole = sum(segment.need for segment in memory)
    fits_whole = SpilledConfig(4, kept + whole * 3 // 2, "host")
    assert len(pack_shards(memory, fits_whole.memory_budget, kept).shards) > 1
    assert simulate_spilled(profile, fits_whole).shards == [[0, 1, 2, 3]]
    assert not any(
        isinstance(p, SpilledPrediction) for p in rank_configs(profile, 1, 4, memory_bytes=fits_whole.memory_budget)
    )
    # Without a budget nothing is spilled either, and VarunaStrategy's choice never is.
    assert all(isinstance(p, Prediction) for p in rank_configs(profile, 2, 4))


def test_cli_autoconfig_ranks_spilled_training_and_names_the_runner_up(tmp_path, capsys):
    profile = profile_of(segments=8)
    path = tmp_path / "profile.json"
    profile.save(str(path))
    assert ModelProfile.load(str(path)) == profile
    budget = min(max(p.memory_bytes) for p in rank_configs(profile, 2, 4)) - 1
    trace = tmp_path / "spilled.json"
    cli(["autoconfig", "--profile", str(path), "--devices", "2", "--batch-size", "4"]
        + ["--memory-budget", str(budget), "--trace", str(trace)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "spilled to host, 1 device" in printed and "spilled to disk, 1 device" in printed
    assert "AutoConfig chose spilled to host" in printed and "runner-up spilled to disk" in printed
    assert f"Best: SpillingStrategy(memory_budget={budget}, spill_dir=None)" in printed
    assert "forward 0" in trace.read_text()
    assert "shards" in format_ranking(rank_configs(profile, 2, 4, memory_bytes=budget)).splitlines()[1]


def test_spill_tiers_are_measured_with_the_store(tmp_path):
    costs = measure_spill_tiers(torch.device("cpu"), tmp_path, sizes=(1 << 16, 1 << 20), repeats=1)
    assert set(costs) == {"host", "disk"}
    assert [n for n, _ in costs["disk"].read.samples] == [1 << 16, 1 << 20]
    assert all(s > 0 for _, s in costs["disk"].read.samples + costs["disk"].write.samples)
    assert not list(tmp_path.iterdir())  # its folder is removed


def test_one_stage_needs_no_network_measurement():
    """A profile of one process (no point-to-point or all-reduce times) still predicts P=1 D=1 and spilled
    configurations, so that it ranks them together."""
    profile = profile_of(segments=4)
    profile.p2p, profile.allreduce = {}, {}
    ranked = rank_configs(profile, 1, 4, memory_bytes=10**9, micro_batch_sizes=[4])
    assert {str(p.config) for p in ranked} == {f"P=1 D=1 mb=4 {schedule}" for schedule in SCHEDULES}


@pytest.mark.slow  # profiles a model and trains it (5 s)
def test_a_launch_logs_the_choice_and_the_runner_up_with_their_predicted_times(tmp_path):
    """What VarunaStrategy logs as it auto-configures (rank 0 decides; here a process group of one, in a process of
    its own so that no other test's group is in the way)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ports import free_port

    path = tmp_path / "launch.json"
    profile_of(segments=4).save(str(path))
    code = f"""
import torch, torch.distributed as dist
from lightning_varuna.profiling.model_costs import ModelCosts
from lightning_varuna.storage import Storage
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
best = ModelCosts({str(path)!r}, Storage(), 1).choose_config(
    1, torch.device("cpu"), 1, global_batch_size=4, pipeline_parallel_size=None, data_parallel_size=None,
    micro_batch_size=None, schedule=None,
)
print("BEST", best)
dist.destroy_process_group()
"""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    best = done.stdout.split("BEST ", 1)[1].strip()
    logged = done.stdout + done.stderr
    assert f"AutoConfig chose {best}: predicted " in logged and "; runner-up P=1 D=1 " in logged
    assert logged.count(" ms a step, ") == 2 and "MiB per device" in logged


def test_calibration_learns_how_much_longer_a_tier_computes_than_profiled():
    """The disk tier's compute taking twice the profiled time (on the CPU its freed memory goes back to the system at
    once, so activations fault their pages in anew) is learned from one measured step and predicts the others."""
    from dataclasses import replace

    from lightning_varuna.profiling.calibration import calibrate_spilled

    profile = profile_of(segments=6)
    slower = replace(profile, spill={**profile.spill, "disk": replace(DISK, compute_factor=2.0)})
    budgets = [SpilledConfig(4, b, "disk") for b in (14000, 30000)]
    measured = [(c, simulate_spilled(slower, c).step_s) for c in budgets]
    calibrated = calibrate_spilled(profile, measured[:1])
    assert calibrated.spill["disk"].compute_factor == pytest.approx(2.0, rel=1e-6)
    assert calibrated.spill["host"].compute_factor == 1.0  # not measured: as profiled
    assert simulate_spilled(calibrated, budgets[1]).step_s == pytest.approx(measured[1][1], rel=1e-6)
    assert ModelProfile.from_json(calibrated.to_json()) == calibrated
