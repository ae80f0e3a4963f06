"""The profiler measures what the simulator needs; the simulator follows the schedules; AutoConfig ranks configs."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace

import pytest
import torch
from models import DIM, SEQ, NormalizesOverRows, TinyLM
from torch import nn

from lightning_varuna import CutPoint, cut_after
from lightning_varuna.cli import main as cli
from lightning_varuna.data.microbatch import microbatch_sizes
from lightning_varuna.partition.discovery import discover_cutpoints
from lightning_varuna.pipeline.schedules import SCHEDULES, interleaved_one_f_one_b, make_schedule
from lightning_varuna.profiling.autoconfig import candidate_configs, choose_configs, format_ranking, rank_configs
from lightning_varuna.profiling.calibration import calibrate, measured_step_s
from lightning_varuna.profiling.memory import SavedTensorMeter
from lightning_varuna.profiling.network import profile_network
from lightning_varuna.profiling.processes import retried_on_port_clash
from lightning_varuna.profiling.profile import (
    LinearCost,
    ModelProfile,
    ProfiledSegment,
    RuntimeOverheads,
    SegmentTiming,
)
from lightning_varuna.profiling.profiler import profile_model, resize_batch
from lightning_varuna.profiling.segments import measure_segments, measure_split_backward
from lightning_varuna.profiling.simulator import Config, simulate
from lightning_varuna.profiling.trace import Span, read_chrome_trace
from lightning_varuna.step_runs import step_run_configs


def tokens(rows: int) -> torch.Tensor:
    return torch.randint(0, 11, (rows, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tiny_profile() -> ModelProfile:
    torch.manual_seed(0)
    return profile_model(TinyLM(), (tokens(4),), micro_batch_sizes=[1, 2], thread_counts=[1], repeats=2, progress=False)


def test_profile_has_a_segment_per_cutpoint_and_sizes_them(tiny_profile):
    model = TinyLM()
    assert tiny_profile.cutpoints == discover_cutpoints(model, (tokens(2),))
    assert len(tiny_profile.segments) == 5 and tiny_profile.segments[-1].name == "<output>"
    assert tiny_profile.micro_batch_sizes == [1, 2] and tiny_profile.thread_counts == [1]
    for segment in tiny_profile.segments[:-1]:
        one, two = segment.timings[1][1], segment.timings[1][2]
        # The activation at the CutPoint: rows x SEQ x DIM float32.
        assert (one.output_bytes, two.output_bytes) == (SEQ * DIM * 4, 2 * SEQ * DIM * 4)
        assert 0 < one.activation_bytes < two.activation_bytes
        assert one.forward_s > 0 and one.backward_s > 0 and one.forward_no_grad_s > 0
    assert tiny_profile.segments[-1].timings[1][1].output_bytes == 0
    # The backward split in two (zero-bubble), per segment: the first segment's input takes no gradient, so its whole
    # backward is the weight part; the others walk their graph in both parts.
    first_input, first_weight = tiny_profile.segments[0].timings[1][2].split_shares
    assert first_input < 0.2 < first_weight
    for segment in tiny_profile.segments[1:]:
        input_share, weight_share = segment.timings[1][2].split_shares
        assert input_share > 0.2 and weight_share > 0.2
    # The tied embedding / head weight is held by the first and the last segment.
    assert "emb.weight" in tiny_profile.segments[0].parameters
    assert "emb.weight" in tiny_profile.segments[-1].parameters
    assert "blocks.2.fc.weight" in tiny_profile.segments[2].parameters
    # AdamW keeps two moments per parameter.
    for segment in tiny_profile.segments:
        assert segment.optimizer_bytes == 2 * sum(segment.parameters.values())


class ThreeLinears(nn.Module):
    """Three layers with a CutPoint after each of the first two; ``frozen``: the first takes no gradient;
    ``in_place``: a ReLU changes the first CutPoint's output in place; ``skip``: a value made before the first
    CutPoint is added after the second (as T5's position bias is)."""

    def __init__(self, frozen: bool = False, in_place: bool = False, skip: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.cuts = nn.ModuleList([CutPoint(), CutPoint()])
        self.layers[0].requires_grad_(not frozen)
        self.in_place, self.skip = in_place, skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        bias = h * 2
        h = self.cuts[0](h)
        h = self.layers[1](h.relu_() if self.in_place else h)
        return self.layers[2](self.cuts[1](h)) + (bias if self.skip else 0)


def test_a_cutpoint_on_the_model_s_output_is_left_out_of_the_profile_as_of_the_cut():
    """`cut_after` on every layer of a model that ends with its last layer puts a CutPoint on the forward's output,
    with no work after it: the profile's segments are those the strategy cuts (it refuses a profile whose CutPoints
    differ), each timed and sized, the last one ending at the output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    cut_after([model[0], model[2]])
    rows = (torch.randn(2, DIM),)
    profile = profile_model(model, rows, micro_batch_sizes=[1, 2], thread_counts=[1], repeats=1, progress=False)
    assert profile.cutpoints == discover_cutpoints(model, rows) == ["0.cutpoint"]
    assert [len(s.parameters) for s in profile.segments] == [2, 2]  # the first Linear's weight and bias; the last's
    last = profile.segments[-1].timings[1][2]
    assert last.forward_s > 0 and last.backward_s > 0 and last.output_bytes == 0
    assert len(measure_segments(model, rows, repeats=1)) == len(measure_split_backward(model, rows, repeats=1)) == 2


def test_split_backward_shares_follow_the_runtime_s_split():
    """The first segment, whose input takes no gradient, runs its backward whole in the weight part, as does a
    segment after frozen layers (and no gradient reaches the frozen one); an in-place change of a CutPoint's output
    is measured; a value that goes past a CutPoint leaves the shares unmeasured (None: the simulator's constants)."""
    x = torch.randn(4, 8)
    first, *rest = measure_split_backward(ThreeLinears(), (x,), repeats=2)
    assert first[0] < 0.2 < first[1] and all(a > 0.2 and b > 0.2 for a, b in rest)
    frozen = measure_split_backward(ThreeLinears(frozen=True), (x,), repeats=2)
    assert frozen[0] is None and frozen[1][0] < 0.2 < frozen[1][1]
    assert all(shares is not None for shares in measure_split_backward(ThreeLinears(in_place=True), (x,)))
    assert measure_split_backward(ThreeLinears(skip=True), (x,)) == [None, None, None]


def test_profile_round_trips_through_an_fsspec_url(tiny_profile):
    tiny_profile.save("memory://profiles/tiny.json")
    assert ModelProfile.load("memory://profiles/tiny.json") == tiny_profile
    assert json.loads(tiny_profile.to_json())["segments"][0]["name"] == "cuts.0"


def test_profiling_again_measures_only_what_is_missing(tiny_profile):
    calibrated = replace(tiny_profile, overheads={2: RuntimeOverheads(forward_s=1e-3)})
    updated = profile_model(
        TinyLM(), (tokens(4),), micro_batch_sizes=[1, 2, 4], thread_counts=[1], previous=calibrated, progress=False
    )
    for old, new in zip(tiny_profile.segments, updated.segments):
        assert new.timings[1][1] == old.timings[1][1] and new.timings[1][2] == old.timings[1][2]
        assert 4 in new.timings[1] and new.optimizer_bytes == old.optimizer_bytes > 0
    assert updated.overheads == calibrated.overheads
    # A changed model is measured afresh, and what calibration learned about the old one is dropped.
    changed = profile_model(
        TinyLM(blocks=4), (tokens(4),), micro_batch_sizes=[1], thread_counts=[1], previous=calibrated, progress=False
    )
    assert len(changed.segments) == 4 and changed.micro_batch_sizes == [1] and changed.overheads == {}


def test_a_batch_norm_model_is_profiled_from_two_rows_and_keeps_its_statistics():
    """Training after profiling starts from the model's own running statistics, as one device's does; a size of one
    row, from which BatchNorm cannot train, is left out by default and named when asked for."""
    torch.manual_seed(0)
    model = NormalizesOverRows()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_model(model, (tokens(4),), thread_counts=[1], repeats=1, progress=False)
    assert profile.micro_batch_sizes == [2, 4, 8]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"`norm` \(BatchNorm1d\).*`micro_batch_sizes=\(2, 4, 8\)`"):
        profile_model(model, (tokens(4),), micro_batch_sizes=[1, 2], thread_counts=[1], repeats=1, progress=False)


def test_resize_batch_repeats_or_cuts_rows():
    x, mask = torch.arange(6).reshape(3, 2), torch.ones(4, 4)
    assert resize_batch((x,), 2)[0].tolist() == [[0, 1], [2, 3]]
    assert resize_batch((x,), 5)[0].tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    # Only batch tensors change; a cut batch owns its memory (a view would charge the whole example batch).
    (cut, same), _ = resize_batch(((x, mask), {}), 1)
    assert same is mask and cut.untyped_storage().nbytes() == cut.numel() * cut.element_size()


def test_saved_tensor_meter_counts_activations_not_weights():
    linear = torch.nn.Linear(256, 256)
    x = torch.randn(1, 256, requires_grad=True)
    counted, activations_only = SavedTensorMeter(), SavedTensorMeter(exclude=linear.parameters())
    for meter in (counted, activations_only):
        with meter.measuring():
            y = linear(x)
        del y
    assert counted.peak >= 256 * 256 * 4  # the matmul saves the weight too
    assert activations_only.peak == 256 * 4  # just the input row


# ------------------------------------------------------------------------------------------- simulator
def synthetic(
    segments: int = 4, forward: float = 1.0, backward: float = 2.0, no_grad: float = 0.5, cores: int = 64
) -> ModelProfile:
    """Segments that each take ``forward``/``backward`` seconds per row, save 100 bytes per row, send 10."""

    def timing(rows: int, last: bool) -> SegmentTiming:
        return SegmentTiming(forward * rows, no_grad * rows, backward * rows, 100 * rows, 0 if last else 10 * rows)

    return ModelProfile(
        model="synthetic",
        device="cpu",
        cores_per_node=cores,
        segments=[
            ProfiledSegment(
                name=f"cut{i}",
                fingerprint=str(i),
                parameters={f"w{i}": 1000},
                optimizer_bytes=2000,
                optimizer_step_s={1: 0.0},
                timings={1: {1: timing(1, i == segments - 1), 2: timing(2, i == segments - 1)}},
            )
            for i in range(segments)
        ],
        p2p={n: LinearCost(0.0, 1e18) for n in range(2, 65)},
        allreduce={n: {d: LinearCost(0.25, 1e3) for d in range(2, 65)} for n in range(2, 65)},
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (2, 4), (4, 8), (2, 1)])
def test_uniform_pipeline_takes_microbatches_plus_stages_minus_one_slots(schedule, stages, microbatches):
    profile = synthetic()
    prediction = simulate(profile, Config(stages, 1, 1, schedule, microbatches), timeline=True)
    per_stage = (1.0 + 2.0) * 4 / stages
    assert prediction.pipeline_s == pytest.approx((microbatches + stages - 1) * per_stage)
    assert prediction.bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))
    ran = sorted((s.stage, s.name) for s in prediction.timeline if s.name[0] in "FB")
    assert ran == sorted(
        (st, str(a)) for st, acts in enumerate(SCHEDULES[schedule](stages, microbatches)) for a in acts
    )


def test_on_the_cpu_a_forwards_activation_travels_while_the_previous_forward_computes():
    """Over gloo (a CPU profile) a stage posts its next forward's receive as the current forward starts computing, so
    an activation sent meanwhile arrives by the time the stage is free; over NCCL (a GPU's) it is posted as that
    forward starts, and each one's transfer (0.5 s here) waits behind the forward before it."""
    cpu = synthetic()
    cpu.p2p = {n: LinearCost(0.5, 1e18) for n in range(2, 65)}
    gpu = copy.deepcopy(cpu)
    gpu.device = "cuda"
    starts = {}
    for name, profile in (("cpu", cpu), ("gpu", gpu)):
        timeline = simulate(profile, Config(2, 1, 1, "gpipe", 4), timeline=True).timeline
        starts[name] = [round(s.start_s, 6) for s in timeline if s.stage == 1 and s.name[0] == "F"]
    # Stage 0 sends micro-batch m at 2 (m + 1) s; a forward of stage 1 takes 2 s.
    assert starts["cpu"] == [2.5, 4.5, 6.5, 8.5]
    assert starts["gpu"] == [2.5, 5.0, 7.5, 10.0]


def test_varuna_schedule_pays_the_recompute_and_saves_activation_memory():
    profile = synthetic()
    plain = simulate(profile, Config(2, 1, 1, "1f1b", 8))
    gpipe = simulate(profile, Config(2, 1, 1, "gpipe", 8))
    varuna = simulate(profile, Config(2, 1, 1, "varuna", 8), timeline=True)
    assert varuna.step_s > plain.step_s
    # Stage 0 runs each forward without grad (0.5/row/segment) and again with (1.0) before the backward.
    stage0 = [s for s in varuna.timeline if s.stage == 0]
    assert {round(s.end_s - s.start_s, 6) for s in stage0 if s.name[0] == "F"} == {1.0}
    assert {round(s.end_s - s.start_s, 6) for s in stage0 if s.name[0] == "R"} == {2.0}
    weights = 2 * 2000 + 2 * 2000  # parameters + gradients + optimizer state of two segments
    assert gpipe.memory_bytes[0] - weights == 8 * 200  # all 8 micro-batches' activations
    assert plain.memory_bytes[0] - weights == 2 * 200  # 1F1B: P - stage in flight
    assert varuna.memory_bytes[0] - weights < plain.memory_bytes[0] - weights


def test_zero_bubble_takes_each_stage_s_split_from_the_profile():
    """Each backward part lasts the profiled share of the stage's backward; the first stage runs its whole backward in
    the weight part (its input takes no gradient), as the runtime does."""
    profile = synthetic()
    for segment in profile.segments:
        for timing in segment.timings[1].values():
            timing.split_shares = (0.75, 0.5)
    timeline = simulate(profile, Config(2, 1, 1, "zero-bubble", 4), timeline=True).timeline
    durations = {(s.stage, s.name[0]): round(s.end_s - s.start_s, 9) for s in timeline if s.name[0] in "BW"}
    backward = 2.0 * 2  # 2 segments of 2 s each per stage
    assert durations == {(0, "B"): 0.0, (0, "W"): backward, (1, "B"): 0.75 * backward, (1, "W"): 0.5 * backward}
    # Calibrated: a backward's cost goes to the backwards that compute something (the input parts, and the first
    # stage's weight part, its whole backward), the weight passes split from a backward take longer.
    profile.overheads = {2: RuntimeOverheads(backward_s=0.25, weight_factor=1.5)}
    timeline = simulate(profile, Config(2, 1, 1, "zero-bubble", 4), timeline=True).timeline
    durations = {(s.stage, s.name[0]): round(s.end_s - s.start_s, 9) for s in timeline if s.name[0] in "BW"}
    assert durations == {
        (0, "B"): 0.0,
        (0, "W"): backward + 0.25,
        (1, "B"): 0.75 * backward + 0.25,
        (1, "W"): 1.5 * 0.5 * backward,
    }


@pytest.mark.parametrize(
    ("schedule", "per_rank", "after"),
    [("1f1b", 1, 1), ("zero-bubble", 1, 2), ("zbv", 2, 1)],  # zero-bubble: the last stage's weight pass ends last
)
def test_the_other_stages_work_on_a_step_s_results_after_the_last_stage_sent_them(schedule, per_rank, after):
    """The last stage works on a step's results (its output, the logged values) and sends them; each other stage
    receives them once its part is done and works on them. Where the last stage's rank finishes its part last, the
    step ends two such works after it; else one after the rank that finishes last."""
    profile = synthetic()
    profile.object_broadcast = {2: {2: 0.25}}
    config = Config(2, 1, 1, schedule, 4, stages_per_rank=per_rank)
    bare = simulate(profile, config, timeline=True)
    ends = [max(s.end_s for s in bare.timeline if s.stage == rank and s.phase is not None) for rank in (0, 1)]
    assert bare.pipeline_s == pytest.approx(max(ends) + 0.25)  # received once the other rank's part is done
    profile.overheads = {2: RuntimeOverheads(step_s=0.5)}
    assert simulate(profile, config).pipeline_s == pytest.approx(bare.pipeline_s + after * 0.5)


def test_replicas_add_the_allreduce_and_share_the_cores():
    alone = simulate(synthetic(), Config(1, 1, 1, "1f1b", 4))
    crowded = simulate(synthetic(cores=1), Config(1, 2, 1, "1f1b", 8))  # 2 processes on 1 core
    roomy = simulate(synthetic(cores=2), Config(1, 2, 1, "1f1b", 8))
    assert roomy.pipeline_s == pytest.approx(alone.pipeline_s)
    assert crowded.pipeline_s == pytest.approx(2 * alone.pipeline_s)
    assert roomy.allreduce_s == pytest.approx(0.25 + 4000 / 1e3)  # all four segments' parameters


def test_stages_on_their_own_nodes_do_not_share_cores():
    crowded = simulate(synthetic(cores=1), Config(2, 1, 1, "1f1b", 4))
    apart = simulate(synthetic(cores=1), Config(2, 1, 1, "1f1b", 4, nodes=2))
    roomy = simulate(synthetic(cores=2), Config(2, 1, 1, "1f1b", 4))
    assert apart.pipeline_s == pytest.approx(roomy.pipeline_s)
    assert apart.pipeline_s < crowded.pipeline_s


def test_configs_the_network_profile_cannot_predict_are_left_out():
    profile = synthetic()
    profile.allreduce = {}  # profiled on one device: no data-parallel all-reduce measured
    with pytest.warns(UserWarning, match="Left out .* all-reduce"):
        ranked = rank_configs(profile, 2, 4)
    assert {p.config.data_parallel_size for p in ranked} == {1}


@pytest.mark.parametrize(("ranks", "per_rank", "microbatches"), [(2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 4, 8)])
def test_interleaved_bubble_is_one_f_one_b_s_over_the_stages_per_rank(ranks, per_rank, microbatches):
    """Megatron-LM's closed form for a uniform pipeline: M (F + B) per rank plus (P - 1)(F + B) / V, where 1F1B
    waits (P - 1)(F + B) (F, B: a rank's share of the model); each rank runs every action of its stages."""
    profile = synthetic(segments=2 * ranks * per_rank)
    config = Config(ranks, 1, 1, "interleaved-1f1b", microbatches, stages_per_rank=per_rank)
    prediction = simulate(profile, config, timeline=True)
    per_rank_share = 3.0 * len(profile.segments) / ranks
    assert prediction.pipeline_s == pytest.approx((microbatches + (ranks - 1) / per_rank) * per_rank_share)
    assert prediction.bubble == pytest.approx((ranks - 1) / (per_rank * microbatches + ranks - 1))
    one_f_one_b = simulate(profile, Config(ranks, 1, 1, "1f1b", microbatches))
    assert prediction.pipeline_s < one_f_one_b.pipeline_s
    assert str(config) == f"P={ranks} D=1 mb=1 interleaved-1f1b V={per_rank}"
    ran = sorted((s.stage, s.name) for s in prediction.timeline if s.phase is not None)
    expected = interleaved_one_f_one_b(ranks, microbatches, per_rank)
    assert ran == sorted((rank, str(a)) for rank, actions in enumerate(expected) for a in actions)


def test_chrome_trace_has_an_event_per_action():
    prediction = simulate(synthetic(), Config(2, 2, 1, "varuna", 4), timeline=True)
    events = json.loads(prediction.chrome_trace())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(prediction.timeline)
    assert {e["name"] for e in spans} >= {"F0", "R0", "B1", "all-reduce", "optimizer"}


# ------------------------------------------------------------------------------------------- AutoConfig
def test_candidates_cover_every_stage_count_that_divides_the_devices():
    configs = candidate_configs(synthetic(segments=3), 6, 12)
    assert {(c.pipeline_parallel_size, c.data_parallel_size) for c in configs} == {(1, 6), (2, 3), (3, 2)}
    assert {c.schedule for c in configs} == set(SCHEDULES)
    # A replica's batch of 2 rows has no room for micro-batches of more than 2.
    assert all(c.micro_batch_size <= c.replica_batch_size for c in configs)


def test_ranking_is_fastest_first_and_respects_memory():
    ranked = rank_configs(synthetic(), 4, 8)
    assert [p.step_s for p in ranked] == sorted(p.step_s for p in ranked)
    limit = sorted(max(p.memory_bytes) for p in ranked)[len(ranked) // 2]
    assert all(max(p.memory_bytes) <= limit for p in rank_configs(synthetic(), 4, 8, memory_bytes=limit))
    with pytest.raises(ValueError, match="No configuration fits"):
        rank_configs(synthetic(), 4, 8, memory_bytes=10)
    with pytest.raises(ValueError, match="No pipeline x data-parallel layout"):
        rank_configs(synthetic(segments=1), 2, 3)
    assert "bubble" in format_ranking(ranked).splitlines()[0]


@pytest.mark.parametrize("schedule", ["1f1b", "varuna"])
def test_calibration_recovers_the_costs_a_measured_step_adds(schedule):
    """Steps "measured" with known extra costs (simulated from a profile that has them) teach an uncalibrated
    profile those costs; its predictions of other configurations with as many processes then match too."""
    costs = RuntimeOverheads(0.3, 0.2, 0.1, 0.5, forward_per_row_s=0.05, backward_per_row_s=0.02, replica_lag=0.25)
    truth = replace(synthetic(), overheads={2: costs})
    measured = [Config(2, 1, 1, schedule, 4), Config(2, 1, 2, "gpipe", 8), Config(1, 2, 2, "gpipe", 8)]
    calibrated = calibrate(synthetic(), [(c, simulate(truth, c, timeline=True).timeline) for c in measured])
    learned = calibrated.overheads[2]
    assert [learned.forward(rows) for rows in (1, 2, 3)] == pytest.approx([costs.forward(rows) for rows in (1, 2, 3)])
    assert [learned.backward(rows) for rows in (1, 2, 3)] == pytest.approx([costs.backward(r) for r in (1, 2, 3)])
    assert (learned.message_s, learned.step_s, learned.replica_lag) == pytest.approx((0.1, 0.5, 0.25), abs=1e-6)
    for other in (Config(2, 1, 2, "1f1b", 6), Config(2, 1, 1, "varuna", 6), Config(1, 2, 1, "1f1b", 4)):
        assert simulate(calibrated, other).step_s == pytest.approx(simulate(truth, other).step_s, abs=1e-5)
    four = Config(4, 1, 1, "1f1b", 4)  # other process counts are not touched
    assert simulate(calibrated, four).step_s == simulate(synthetic(), four).step_s
    # One micro-batch size: a constant cost per action that reproduces that measured step.
    one = calibrate(synthetic(), [(measured[0], simulate(truth, measured[0], timeline=True).timeline)])
    assert one.overheads[2].forward(1) == one.overheads[2].forward(2)  # constant
    assert one.overheads[2].backward(1) == one.overheads[2].backward(2)
    assert one.overheads[2].replica_lag == 0  # nothing measured with replicas
    # Calibrated again with that one run, a profile keeps what the run does not teach (the profile's own step runs
    # taught it): the replicas' wait and the weight passes' factor.
    taught = replace(synthetic(), overheads={2: replace(costs, weight_factor=1.5)})
    again = calibrate(taught, [(measured[0], simulate(truth, measured[0], timeline=True).timeline)])
    assert again.overheads[2].replica_lag == 0.25 and again.overheads[2].weight_factor == 1.5
    assert again.overheads[2].forward_s == pytest.approx(one.overheads[2].forward_s)  # the rest, learned anew
    assert simulate(one, measured[0]).step_s == pytest.approx(simulate(truth, measured[0]).step_s, abs=1e-5)
    calibrated.save("memory://profiles/calibrated.json")
    assert ModelProfile.load("memory://profiles/calibrated.json") == calibrated


def test_calibration_keeps_the_cost_per_action_of_each_micro_batch_size():
    """Per-action costs that are not a line in the rows (the runtime's and the user's step cost less per row at some
    sizes than at others) are learned at each measured size, so a configuration at one of them is predicted as
    measured; between two sizes the cost is linear, beyond them it follows the line fitted to all."""
    costs = RuntimeOverheads(message_s=0.1, step_s=0.5, by_rows=[(1, 0.2, 0.3), (2, 0.6, 0.9), (4, 0.7, 1.0)])
    truth = replace(synthetic(), overheads={2: costs})
    measured = [Config(2, 1, mb, "gpipe", 4 * mb) for mb in (1, 2, 4)]
    calibrated = calibrate(synthetic(), [(c, simulate(truth, c, timeline=True).timeline) for c in measured])
    learned = calibrated.overheads[2]
    assert [x for entry in learned.by_rows for x in entry] == pytest.approx([1, 0.2, 0.3, 2, 0.6, 0.9, 4, 0.7, 1.0])
    for other in (Config(2, 1, 2, "1f1b", 6), Config(2, 1, 4, "zbv", 16, stages_per_rank=2)):
        assert simulate(calibrated, other).step_s == pytest.approx(simulate(truth, other).step_s, rel=1e-6)
    assert learned.forward(3) == pytest.approx(0.65) and learned.backward(3) == pytest.approx(0.95)  # between
    assert learned.forward(8) == pytest.approx(0.7 + 4 * learned.forward_per_row_s)  # beyond: along the line
    assert 0 < learned.forward_per_row_s < 0.4
    assert ModelProfile.from_json(calibrated.to_json()) == calibrated


def test_calibration_learns_where_the_profile_over_estimates_a_micro_batch_size():
    """Actions that run faster than profiled at some size (a profile's noise, caches) give that size a negative cost
    per action, so that its configurations are predicted as measured; no action takes less than no time."""
    costs = RuntimeOverheads(message_s=0.1, step_s=0.5, by_rows=[(1, -0.8, -0.6), (2, -0.5, -0.3)])
    truth = replace(synthetic(), overheads={2: costs})
    measured = [Config(2, 1, mb, "gpipe", 4 * mb) for mb in (1, 2)]
    calibrated = calibrate(synthetic(), [(c, simulate(truth, c, timeline=True).timeline) for c in measured])
    learned = calibrated.overheads[2]
    assert [x for entry in learned.by_rows for x in entry] == pytest.approx([1, -0.8, -0.6, 2, -0.5, -0.3])
    other = Config(2, 1, 2, "1f1b", 6)
    assert simulate(calibrated, other).step_s == pytest.approx(simulate(truth, other).step_s, rel=1e-6)
    assert learned.forward(4) == pytest.approx(-0.5 + 2 * 0.3)  # beyond: along the rising line, negative or not
    faster = replace(truth, overheads={2: RuntimeOverheads(by_rows=[(1, -100.0, -100.0)])})
    timeline = simulate(faster, Config(2, 1, 1, "1f1b", 4), timeline=True).timeline
    assert {s.end_s - s.start_s for s in timeline if s.name[0] in "FB"} == {0.0}


def test_calibration_learns_how_much_longer_deferred_weight_passes_take():
    """A zero-bubble step "measured" with weight passes 1.5x their profiled time teaches that factor; it then
    predicts the other split schedules, and runs without weight passes leave it unknown (as profiled)."""
    costs = RuntimeOverheads(0.3, 0.2, 0.1, 0.5, weight_factor=1.5)
    truth = replace(synthetic(), overheads={2: costs})
    zero_bubble, gpipe = Config(2, 1, 1, "zero-bubble", 4), Config(2, 1, 1, "gpipe", 4)
    calibrated = calibrate(synthetic(), [(c, simulate(truth, c, timeline=True).timeline) for c in (zero_bubble, gpipe)])
    assert calibrated.overheads[2].weight_factor == pytest.approx(1.5, rel=1e-6)
    zbv = Config(2, 1, 1, "zbv", 6, stages_per_rank=2)
    assert simulate(calibrated, zbv).step_s == pytest.approx(simulate(truth, zbv).step_s, rel=1e-6)
    assert (
        simulate(calibrated, zbv).step_s
        > simulate(replace(truth, overheads={2: replace(costs, weight_factor=None)}), zbv).step_s
    )
    assert ModelProfile.from_json(calibrated.to_json()) == calibrated
    unsplit = calibrate(synthetic(), [(gpipe, simulate(truth, gpipe, timeline=True).timeline)])
    assert unsplit.overheads[2].weight_factor is None
    # A one-stage split backward's weight parts are whole backwards (its input takes no gradient): its run teaches
    # the costs per action, and no weight factor.
    one_stage, one_process = Config(1, 1, 1, "zero-bubble", 4), replace(synthetic(), overheads={1: costs})
    alone = calibrate(synthetic(), [(one_stage, simulate(one_process, one_stage, timeline=True).timeline)])
    assert alone.overheads[1].weight_factor is None
    assert (alone.overheads[1].forward(1), alone.overheads[1].backward(1)) == pytest.approx((0.3, 0.2), abs=1e-6)
    assert simulate(alone, one_stage).step_s == pytest.approx(simulate(one_process, one_stage).step_s, rel=1e-4)
    # Runs that all split the backward teach the other costs and the weight passes' together.
    alone = calibrate(synthetic(), [(zero_bubble, simulate(truth, zero_bubble, timeline=True).timeline)])
    assert alone.overheads[2].weight_factor == pytest.approx(1.5, rel=1e-4)
    assert simulate(alone, zero_bubble).step_s == pytest.approx(simulate(truth, zero_bubble).step_s, rel=1e-4)


def test_calibration_learns_the_optimizer_step_and_the_reduction_from_their_own_spans():
    """A step "measured" with an optimizer step 0.6x its profiled time and a reduction of the tied weights 0.3 s
    longer than its transfer teaches both apart from the per-step cost: a schedule that puts the tied weights on one
    rank (zbv: nothing to reduce) is then predicted as measured, which one per-step cost for all could not do."""
    tied = synthetic(segments=4)
    for segment in tied.segments:
        segment.optimizer_step_s = {1: 0.5}
    tied.segments[0].parameters["embedding"] = tied.segments[-1].parameters["embedding"] = 1000  # and the head
    costs = RuntimeOverheads(0.3, 0.2, 0.1, 0.5, optimizer_factor=0.6, reduce_s=0.3)
    truth = replace(tied, overheads={2: costs})
    one_f_one_b, zbv = Config(2, 1, 2, "1f1b", 8), Config(2, 1, 2, "zbv", 8, stages_per_rank=2)
    assert simulate(truth, one_f_one_b).allreduce_s > 0.3 and simulate(truth, zbv).allreduce_s == 0
    calibrated = calibrate(tied, [(one_f_one_b, simulate(truth, one_f_one_b, timeline=True).timeline)])
    learned = calibrated.overheads[2]
    assert (learned.optimizer_factor, learned.reduce_s, learned.step_s) == pytest.approx((0.6, 0.3, 0.5), abs=1e-6)
    assert simulate(calibrated, zbv).step_s == pytest.approx(simulate(truth, zbv).step_s, rel=1e-6)
    nothing_reduced = calibrate(tied, [(zbv, simulate(truth, zbv, timeline=True).timeline)])
    assert nothing_reduced.overheads[2].reduce_s is None  # not learned: the transfer alone, as profiled
    # On 4 stages only the first and the last reduce (the tied weights); the middle ones' reductions, which sum
    # nothing and may start last, do not teach the cost.
    four = Config(4, 1, 1, "1f1b", 4)
    truth = replace(tied, overheads={4: costs})
    measured = simulate(truth, four, timeline=True).timeline
    assert {s.stage for s in measured if s.work == "all-reduce"} == {0, 3}
    end = max(s.end_s for s in measured if s.work == "all-reduce")
    measured += [Span(rank, "all-reduce", end, end + 1e-5) for rank in (1, 2)]
    assert calibrate(tied, [(four, measured)]).overheads[4].reduce_s == pytest.approx(0.3, abs=1e-6)
    assert ModelProfile.from_json(calibrated.to_json()) == calibrated


def test_step_runs_cover_each_process_count_s_schedules_and_replicas():
    """Per process count: a pipeline of as many stages at the smallest, a middle and the largest micro-batch size,
    its backward split at the middle one, and replicas; with fewer segments than processes, as many stages as there
    are segments that divide the processes, the rest replicas."""

    def runs(profile: ModelProfile, processes: int) -> list[tuple]:
        configs = step_run_configs(profile, processes)
        assert all(c.world_size == processes and c.global_batch_size % (c.micro_batch_size * processes) == 0
                   for c in configs)  # fmt: skip
        return [(c.pipeline_parallel_size, c.data_parallel_size, c.micro_batch_size, c.schedule) for c in configs]

    profile = synthetic(segments=4)
    assert profile.micro_batch_sizes == [1, 2]
    assert runs(profile, 1) == [(1, 1, 1, "1f1b"), (1, 1, 2, "1f1b")]
    assert runs(profile, 2) == [(2, 1, 1, "1f1b"), (2, 1, 2, "1f1b"), (2, 1, 2, "zero-bubble"), (1, 2, 2, "1f1b")]
    assert runs(profile, 4)[-1] == (1, 4, 2, "1f1b")
    assert runs(synthetic(segments=2), 3) == [(1, 3, 1, "1f1b"), (1, 3, 2, "1f1b")]
    assert runs(synthetic(segments=3), 4) == [(2, 2, 1, "1f1b"), (2, 2, 2, "1f1b"), (2, 2, 2, "zero-bubble")]


@pytest.mark.slow  # the CLI measures collectives between 2 processes, and trains a few steps at each count
def test_cli_profiles_and_autoconfigures(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    model = f"{os.path.dirname(__file__)}/models.py:TinyLM"
    command = ["profile", model, "--input-shape", f"4x{SEQ}", "--input-dtype", "int64"]
    command += ["--micro-batch-sizes", "1", "2", "--devices", "2", "--output", str(out)]
    cli([*command, "--no-step-runs"])
    profile = ModelProfile.load(str(out))
    assert profile.micro_batch_sizes == [1, 2] and 2 in profile.p2p and 2 in profile.allreduce[2]
    assert not profile.overheads
    # What it lacks: a few training steps per process count, which calibrate it.
    cli([*command, "--update"])
    profile = ModelProfile.load(str(out))
    assert sorted(profile.overheads) == [1, 2]
    assert profile.overheads[2].weight_factor is not None  # a zero-bubble run was among them
    trace = tmp_path / "t.json"
    cli(
        [
            "autoconfig",
            "--profile",
            str(out),
            "--devices",
            "2",
            "--batch-size",
            "4",
            "--trace",
            str(trace),
        ]
    )
    printed = capsys.readouterr().out
    assert "Best: VarunaStrategy(pipeline_parallel_size=" in printed
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.slow
# ------------------------------------------------------------------------------------------- in training
def test_auto_configured_run_trains_like_one_device_and_traces_its_step(tmp_path):
    """``"auto"`` picks AutoConfig's best for the world size (stages, micro-batch size and schedule); the run
    matches single-device training; a PipelineTrace of the step shows every action of the chosen schedule on
    every stage."""
    from reference import train_reference
    from test_parity import run_pipelined

    torch.manual_seed(0)
    profile = profile_model(TinyLM(), (tokens(6),), micro_batch_sizes=[1, 2, 3], thread_counts=[1], progress=False)
    profile_network(profile, [2], progress=False)
    profile.save(str(tmp_path / "tiny.json"))
    config = dict(
        pipeline_parallel_size="auto",
        data_parallel_size=None,
        micro_batch_size="auto",
        schedule="auto",
        profile=str(tmp_path / "tiny.json"),
        global_batch_size=6,
        devices=2,
        batch_size=6,
        rows=18,
        epochs=1,
        trace=str(tmp_path / "step1.json"),
    )
    result, _ = run_pipelined(tmp_path, config)
    best = rank_configs(profile, 2, 6)[0].config
    P, D, mb = result["shape"]
    assert (P, D, mb) == (best.pipeline_parallel_size, best.data_parallel_size, best.micro_batch_size)
    assert result["schedule"] == best.schedule
    reference, _ = train_reference({**config, "data_parallel_size": D, "batch_size": 6 // D})
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)

    # The measured step teaches the profile what the segments leave out: it then predicts that step.
    cli(["calibrate", "--profile", str(tmp_path / "tiny.json"), "--trace", str(tmp_path / "step1.json")])
    calibrated = ModelProfile.load(str(tmp_path / "tiny.json"))
    spans, metadata = read_chrome_trace((tmp_path / "step1.json").read_text())
    assert Config(**metadata["config"]) == best
    assert len({s.step for s in spans}) == 2  # PipelineTrace(step=1, steps=2): the median one is calibrated on
    assert simulate(calibrated, best).step_s == pytest.approx(measured_step_s(spans), rel=1e-3)

    events = [e for e in json.loads((tmp_path / "step1.json").read_text())["traceEvents"] if e["ph"] == "X"]
    for replica in range(D):
        schedule = make_schedule(best.schedule, P, len(microbatch_sizes(6 // D, mb)), best.stages_per_rank)
        for stage, actions in enumerate(schedule):  # a thread per rank (its stages, where interleaved)
            mine = [e for e in events if (e["pid"], e["tid"], e["args"]["step"]) == (replica, stage, 1)]
            mine.sort(key=lambda e: e["ts"])
            assert [e["name"] for e in mine] == [*map(str, actions), "all-reduce", "optimizer"]
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))  # one at a time


def test_auto_needs_a_profile_and_a_global_batch():
    from lightning_varuna import VarunaStrategy

    with pytest.raises(ValueError, match=r'pipeline_parallel_size="auto".*pass `profile=`.*global_batch_size='):
        VarunaStrategy(pipeline_parallel_size="auto")
    with pytest.raises(ValueError, match=r"must be a positive integer or \"auto\""):
        VarunaStrategy(micro_batch_size="fast")
    with pytest.raises(ValueError, match=r'schedule="auto".*pass `profile=`'):
        VarunaStrategy(schedule="auto")
    with pytest.raises(
        ValueError,
        match=r"unknown; choose one of \['1f1b', 'gpipe', 'interleaved-1f1b', 'varuna', 'zbv', 'zero-bubble'\] "
        r"or \"auto\"",
    ):
        VarunaStrategy(schedule="zigzag")


def test_choose_configs_keeps_the_sizes_given():
    """What VarunaStrategy runs with some sizes "auto": only configurations with the fixed sizes, fastest first."""
    free = choose_configs(synthetic(), 2, 4)
    fixed = choose_configs(synthetic(), 2, 4, pipeline_parallel_size=2, schedule="gpipe")
    assert {p.config.pipeline_parallel_size for p in free} == {1, 2}
    assert fixed and all(p.config.pipeline_parallel_size == 2 and p.config.schedule == "gpipe" for p in fixed)
    assert [p.step_s for p in fixed] == sorted(p.step_s for p in fixed)
    with pytest.raises(ValueError, match="with the sizes you fixed"):
        choose_configs(synthetic(), 2, 4, pipeline_parallel_size=2, data_parallel_size=2)


def test_autoconfig_ranks_interleaving_where_it_is_predicted_fastest(tmp_path, capsys):
    """Uniform segments and free messages: two stages per rank halve 1F1B's bubble and beat the schedules of one
    stage per rank; the ranking prints it with its V, and a memory budget or a fixed V binds it as any other size."""
    profile = synthetic(segments=4, forward=2.0, backward=1.0)
    ranked = rank_configs(profile, 2, 4)
    best = ranked[0]
    assert best.config == Config(2, 1, 1, "interleaved-1f1b", 4, stages_per_rank=2)
    assert best.step_s < min(p.step_s for p in ranked if p.config.stages_per_rank == 1)
    assert "P=2 D=1 mb=1 interleaved-1f1b V=2" in format_ranking(ranked).splitlines()[1]
    chosen = choose_configs(profile, 2, 4, pipeline_parallel_size=2, schedule="interleaved-1f1b")
    assert chosen and all(p.config.schedule == "interleaved-1f1b" for p in chosen)
    # More stages in flight cost memory: a budget just below its peak leaves it out, as it would any configuration.
    within = rank_configs(profile, 2, 4, memory_bytes=max(best.memory_bytes) - 1, spilled=False)
    assert all(max(p.memory_bytes) < max(best.memory_bytes) for p in within)
    assert best.config not in [p.config for p in within]
    # Eight segments offer V = 2, 3 and 4 at P = 2; a fixed V keeps only it.
    eight = synthetic(segments=8, forward=2.0, backward=1.0)
    offered = {c.stages_per_rank for c in candidate_configs(eight, 2, 4) if c.schedule == "interleaved-1f1b"}
    assert offered == {2, 3, 4}
    bound = choose_configs(eight, 2, 4, schedule="interleaved-1f1b", stages_per_rank=3)
    assert {p.config.stages_per_rank for p in bound} == {3}

    profile.save(str(tmp_path / "uniform.json"))
    cli(["autoconfig", "--profile", str(tmp_path / "uniform.json"), "--devices", "2", "--batch-size", "4"])
    printed = capsys.readouterr().out
    assert printed.splitlines()[1].split()[1:6] == ["P=2", "D=1", "mb=1", "interleaved-1f1b", "V=2"]
    assert "schedule='interleaved-1f1b', stages_per_rank=2) on 2 devices" in printed


def test_interleaving_is_not_offered_where_its_rules_exclude_it():
    """Interleaving needs 2 or more ranks, P x V stages of the profile's segments, and micro-batches that split into
    its rounds (5 micro-batches on 2 ranks make 2 rounds, which do not divide them)."""
    three = candidate_configs(synthetic(segments=3), 2, 4)  # P = 2 x V = 2 would need 4 segments
    assert three and all(c.stages_per_rank == 1 for c in three)
    assert "interleaved-1f1b" not in {c.schedule for c in candidate_configs(synthetic(segments=8), 1, 4)}
    uneven = [c for c in candidate_configs(synthetic(segments=4), 2, 5) if c.schedule == "interleaved-1f1b"]
    assert {c.micro_batch_size for c in uneven} == {2}  # [2, 3]: 2 micro-batches in one round; not 5 of 1 row
    with pytest.raises(ValueError, match=r"No pipeline .* with at most 3 stages \(an interleaved schedule needs"):
        choose_configs(synthetic(segments=3), 2, 4, schedule="interleaved-1f1b")


def test_auto_sizes_choose_within_the_interleaved_schedule():
    """`schedule="interleaved-1f1b"` with "auto" sizes is planned, not refused: V is chosen with the sizes unless
    `stages_per_rank` fixes it."""
    from lightning_varuna import VarunaStrategy

    free = VarunaStrategy(
        schedule="interleaved-1f1b", pipeline_parallel_size="auto", profile="p.json", global_batch_size=4
    )._config
    fixed = VarunaStrategy(
        schedule="interleaved-1f1b",
        micro_batch_size="auto",
        pipeline_parallel_size=2,
        stages_per_rank=3,
        profile="p.json",
        global_batch_size=4,
    )._config
    cpu = torch.device("cpu")
    assert free.sizes_to_keep(0, 0, "interleaved-1f1b", cpu)["stages_per_rank"] is None
    assert fixed.sizes_to_keep(2, 0, "interleaved-1f1b", cpu)["stages_per_rank"] == 3
    chosen = Config(2, 1, 1, "interleaved-1f1b", 4, stages_per_rank=4)
    assert free.layout_of(chosen, "interleaved-1f1b", 2, None) == (2, None, 4, False)
    assert fixed.layout_of(None, "interleaved-1f1b", 2, 1) == (2, 1, 3, False)


def test_a_run_whose_port_another_process_took_starts_again_and_other_failures_do_not():
    calls: list[int] = []

    def clashes_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("The server socket has failed to listen on any local network address. (EADDRINUSE)")
        return "trained"

    assert retried_on_port_clash(clashes_once) == "trained" and len(calls) == 2
    calls.clear()

    def fails() -> None:
        calls.append(1)
        raise RuntimeError("a rank ran out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        retried_on_port_clash(fails)
    assert len(calls) == 1
