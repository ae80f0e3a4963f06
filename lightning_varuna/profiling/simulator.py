"""Predict the step time and memory of a pipeline configuration from a profile, by simulating its schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from lightning_varuna.data.microbatch import microbatch_sizes
from lightning_varuna.partition.balance import balance_stages
from lightning_varuna.pipeline.schedules import (
    V_SHAPED,
    Action,
    Phase,
    Work,
    chain,
    dependencies,
    make_schedule,
    rank_of_stage,
    stages_of_rank,
)
from lightning_varuna.profiling.profile import LinearCost, ModelProfile, RuntimeOverheads, SegmentTiming
from lightning_varuna.profiling.trace import Span, chrome_trace

__all__ = ["Config", "MissingMeasurement", "Prediction", "Span", "simulate"]


class MissingMeasurement(ValueError):
    """The profile lacks a network measurement the configuration needs."""


# A split backward (zero-bubble) against the whole one, where the profile did not measure it per segment: its
# input-gradient part, then its weight part. torch's `stage_backward_input` walks the autograd graph in Python and
# hooks where the parameters' paths join the inputs'; measured on a 4-block stage of examples/gpt.py's GPT on the CPU
# (micro-batch 4, one thread): 8.0 and 5.0 ms against 7.8 ms whole (benchmarks/README.md, "Zero-bubble").
SPLIT_SHARES = (8.0 / 7.8, 5.0 / 7.8)


@dataclass(frozen=True)
class Config:
    """A way to run the model: ``pipeline_parallel_size`` stages x ``data_parallel_size`` replicas (with
    ``stages_per_rank`` > 1, an interleaved schedule: ``pipeline_parallel_size`` ranks of that many stages each)."""

    pipeline_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    schedule: str
    global_batch_size: int
    nodes: int = 1
    stages_per_rank: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    @property
    def processes_per_node(self) -> int:
        return math.ceil(self.world_size / self.nodes)

    @property
    def replica_batch_size(self) -> int:
        return self.global_batch_size // self.data_parallel_size

    def __str__(self) -> str:
        per_rank = f" V={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        return (
            f"P={self.pipeline_parallel_size} D={self.data_parallel_size} mb={self.micro_batch_size} "
            f"{self.schedule}{per_rank}"
        )


@dataclass
class Prediction:
    config: Config
    step_s: float
    pipeline_s: float  # the pipelined forward/backward of every micro-batch
    allreduce_s: float  # gradients over the replicas, then tied weights over the stages that hold them
    optimizer_s: float
    bubble: float  # share of the pipeline time the ranks sit idle, on average
    memory_bytes: list[int]  # peak per rank (its stages): parameters, gradients, optimizer state, activations
    boundaries: list[int]  # first segment of each stage
    cut_at: list[str]  # the CutPoints where stages 1, 2, ... begin (as VarunaStrategy's log names the cut)
    timeline: list[Span] = field(default_factory=list)

    def chrome_trace(self) -> str:
        """The step as a Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing)."""
        return chrome_trace(self.timeline, f"predicted: {self.config}")


@dataclass(frozen=True)
class _CoreSharing:
    """How the processes of a node share its CPU cores (processor sharing); on GPUs each has its own device."""

    node_of_stage: list[int]  # the node of each stage of replica 0 (ranks are replica-major, the last stage first)
    copies: int  # replicas of a stage on one node: they run in lockstep and compete with each other
    streams: float  # processes a node runs at full speed at once (cores / threads per process); 0: no sharing

    @classmethod
    def of(cls, profile: ModelProfile, stages: int, processes_per_node: int, threads: int) -> _CoreSharing:
        on_cpu = not profile.device.startswith("cuda")
        return cls(
            node_of_stage=[(stages - 1 - s) // processes_per_node for s in range(stages)],
            copies=max(1, processes_per_node // stages),
            streams=profile.cores_per_node / threads if on_cpu else 0.0,
        )

    def rate(self, stage: int, active: list[int]) -> float:
        """Speed of ``stage`` (1 = as profiled) while the stages ``active`` compute."""
        if not self.streams:
            return 1.0
        busy = self.copies * sum(self.node_of_stage[s] == self.node_of_stage[stage] for s in active)
        return min(1.0, self.streams / busy)

    @property
    def slowdown_all_busy(self) -> float:
        """How much slower a step that every process runs at once (the optimizer step) takes than profiled."""
        if not self.streams:
            return 1.0
        busy = self.copies * max(self.node_of_stage.count(n) for n in set(self.node_of_stage))
        return max(1.0, busy / self.streams)


@dataclass
class _Stage:
    forward_s: float  # with activations kept
    forward_no_grad_s: float
    backward_s: float
    output_bytes: int  # sent to the next stage per micro-batch (and its gradient back)
    input_bytes: int
    activation_bytes: int
    split_s: tuple[float, float]  # the backward split in two (zero-bubble): the input part's and the weight part's


def simulate(profile: ModelProfile, config: Config, *, timeline: bool = False) -> Prediction:
    """Predict one training step of ``config``: the schedule's dependencies and point-to-point transfers,
    processes sharing the CPU cores of a node, the gradient all-reduce and the optimizer step."""
    P, D, mb = config.pipeline_parallel_size, config.data_parallel_size, config.micro_batch_size
    processes_per_node = config.processes_per_node
    threads = profile.threads_per_process(processes_per_node)
    sharing = _CoreSharing.of(profile, P, processes_per_node, threads)
    sizes = microbatch_sizes(config.replica_batch_size, mb)
    num_stages = P * config.stages_per_rank
    v_shape = config.schedule in V_SHAPED  # else stage s on rank position s % P
    starts = balance_stages(profile.segment_costs(threads, mb), num_stages)
    bounds = [*starts, len(profile.segments)]
    stages = {size: _stages(profile, bounds, threads, size) for size in set(sizes)}
    actions = make_schedule(config.schedule, P, len(sizes), config.stages_per_rank)
    overheads = profile.overheads.get(processes_per_node, RuntimeOverheads())
    rank_of = partial(rank_of_stage, num_ranks=P, v_shape=v_shape)
    spans, ends = _run_pipeline(actions, sizes, stages, profile, processes_per_node, sharing, overheads, rank_of)
    broadcast_s = _object_broadcast(profile, processes_per_node, P) if P > 1 else 0.0
    pipeline_s = _results_shared(ends, rank_of(num_stages - 1), overheads.step_s, broadcast_s)
    segments_of = [
        [i for s in stages_of_rank(r, P, config.stages_per_rank, v_shape) for i in range(bounds[s], bounds[s + 1])]
        for r in range(P)
    ]
    rank_params = [_stage_parameters(profile, segments) for segments in segments_of]
    allreduce_s, reducing = 0.0, set(range(P)) if D > 1 else set()
    if D > 1:
        allreduce_s = max(_allreduce(profile, processes_per_node, D)(b) for b in rank_params)
        allreduce_s += overheads.replica_lag * pipeline_s
    for name, holders in _tied_parameters(profile, segments_of).items():  # tied weights: summed across their ranks
        allreduce_s += _allreduce(profile, processes_per_node, len(holders))(_parameter_bytes(profile, name))
        reducing |= holders
    if allreduce_s and overheads.reduce_s is not None:
        allreduce_s = max(0.0, allreduce_s + overheads.reduce_s)
    optimizer_s = (
        max(sum(profile.optimizer_step_s(i, threads) for i in segments) for segments in segments_of)
        * sharing.slowdown_all_busy
        * (1.0 if overheads.optimizer_factor is None else overheads.optimizer_factor)
    )
    step_s = pipeline_s + allreduce_s + optimizer_s
    busy = [sum(sp.end_s - sp.start_s for sp in spans if sp.stage == r) for r in range(P)]
    bubble = 1.0 - sum(busy) / (P * pipeline_s) if pipeline_s > 0 else 0.0
    memory = [
        2 * rank_params[r]
        + sum(profile.segments[i].optimizer_bytes for i in segments_of[r])
        + _peak_activations(actions[r], r, stages[mb] if mb in stages else stages[sizes[0]])
        for r in range(P)
    ]
    if timeline:
        spans += [Span(s, "all-reduce", pipeline_s, pipeline_s + allreduce_s) for s in sorted(reducing) if allreduce_s]
        spans += [Span(s, "optimizer", pipeline_s + allreduce_s, step_s) for s in range(P)]
    return Prediction(
        config=config,
        step_s=step_s,
        pipeline_s=pipeline_s,
        allreduce_s=allreduce_s,
        optimizer_s=optimizer_s,
        bubble=bubble,
        memory_bytes=memory,
        boundaries=starts,
        cut_at=[profile.cutpoints[start - 1] for start in starts[1:]],
        timeline=spans if timeline else [],
    )


def _stages(profile: ModelProfile, bounds: list[int], threads: int, micro_batch_size: int) -> list[_Stage]:
    stages = []
    for s in range(len(bounds) - 1):
        timings: list[SegmentTiming] = [
            profile.timing(i, threads, micro_batch_size) for i in range(bounds[s], bounds[s + 1])
        ]
        before = profile.timing(bounds[s] - 1, threads, micro_batch_size).output_bytes if s else 0
        stages.append(
            _Stage(
                forward_s=sum(t.forward_s for t in timings),
                forward_no_grad_s=sum(t.forward_no_grad_s for t in timings),
                backward_s=sum(t.backward_s for t in timings),
                output_bytes=timings[-1].output_bytes,
                input_bytes=before,
                activation_bytes=sum(t.activation_bytes for t in timings),
                split_s=_split_backward_s(timings, first=s == 0),
            )
        )
    return stages


def _split_backward_s(timings: list[SegmentTiming], first: bool) -> tuple[float, float]:
    """A stage's backward split in two, from its segments' measured shares (or `SPLIT_SHARES`); a first stage, whose
    input takes no gradient, runs its whole backward in the weight part."""
    backward = sum(t.backward_s for t in timings)
    if first:
        return 0.0, backward
    return (
        sum(t.backward_s * (t.split_shares or SPLIT_SHARES)[0] for t in timings),
        sum(t.backward_s * (t.split_shares or SPLIT_SHARES)[1] for t in timings),
    )


def _run_pipeline(
    actions: list[list[Action]],
    sizes: list[int],
    stages_by_size: dict[int, list[_Stage]],
    profile: ModelProfile,
    processes_per_node: int,
    sharing: _CoreSharing,
    overheads: RuntimeOverheads,
    rank_of: Callable[[int], int],
) -> tuple[list[Span], list[float]]:
    """Event simulation of one replica's ranks (``actions``: each rank's, of one stage or several, stage ``s`` on rank
    ``rank_of(s)``); the ranks that
    compute at once on a node share its cores (processor sharing). A gradient arrives one transfer after it was
    produced (its receive is posted early); an activation one transfer after both it was sent and its receive was
    posted: as its consumer starts the forward or, on the CPU (gloo), as the consumer's previous forward of a
    micro-batch of the same size started computing (the runtime posts it then); between two stages of one rank a
    value takes no transfer."""
    P = len(actions)
    microbatches = [stages_by_size[size] for size in sizes]
    transfer = _p2p(profile, processes_per_node) if P > 1 else _no_transfer  # one stage sends nothing

    def send(nbytes: float) -> float:
        return transfer(nbytes) + overheads.message_s

    recomputed = {(a.stage_on(r), a.microbatch) for r in range(P) for a in actions[r] if a.phase is Phase.RECOMPUTE}
    split = {(a.stage_on(r), a.microbatch) for r in range(P) for a in actions[r] if a.phase is Phase.WEIGHT}
    producers, consumers = chain(len(microbatches[0]))
    finished: dict[Work, float] = {}
    position = [0] * P
    remaining = [0.0] * P
    running: list[Action | None] = [None] * P
    started = [0.0] * P
    free_at = [0.0] * P
    early_receives = profile.device == "cpu"
    forward_started: dict[tuple[int, int], float] = {}  # (stage, micro-batch)
    spans: list[Span] = []
    now = 0.0

    def duration(rank: int, action: Action) -> float:
        """The action's profiled time and its calibrated cost (which may be negative: never below no time)."""
        stage, m = action.stage_on(rank), action.microbatch
        cost = microbatches[m][stage]
        if action.phase is Phase.FORWARD:
            forward = cost.forward_no_grad_s if (stage, m) in recomputed else cost.forward_s
            return max(0.0, forward + overheads.forward(sizes[m]))
        if action.phase is Phase.RECOMPUTE:
            return cost.forward_s
        if (stage, m) not in split:
            return max(0.0, cost.backward_s + overheads.backward(sizes[m]))
        input_part, weight_part = cost.split_s
        if stage == 0:  # a first stage's input takes no gradient: its input part does nothing, its weight part is all
            return 0.0 if action.phase is Phase.BACKWARD else max(0.0, cost.backward_s + overheads.backward(sizes[m]))
        if action.phase is Phase.BACKWARD:
            return max(0.0, input_part + overheads.backward(sizes[m]))
        return weight_part * (1.0 if overheads.weight_factor is None else overheads.weight_factor)

    def ready_at(rank: int, action: Action) -> float | None:
        """When ``rank`` may start ``action``: its dependencies finished and their messages arrived."""
        stage, m, at = action.stage_on(rank), action.microbatch, free_at[rank]
        for work in dependencies(stage, action, producers, consumers, (stage, m) in recomputed):
            other, phase, _ = work
            if work not in finished:
                return None
            if rank_of(other) == rank:  # a stage of this rank: the value is at hand
                at = max(at, finished[work])
            elif phase is Phase.FORWARD:
                posted = free_at[rank]
                if early_receives and m > 0 and sizes[m] == sizes[m - 1] and (stage, m - 1) in forward_started:
                    posted = min(posted, forward_started[(stage, m - 1)])
                at = max(at, max(finished[work], posted) + send(microbatches[m][other].output_bytes))
            else:  # the gradient's receive was posted at the forward: it travels as soon as it is sent
                at = max(at, finished[work] + send(microbatches[m][other].input_bytes))
        return at

    while True:
        for s in range(P):
            if running[s] is None and position[s] < len(actions[s]):
                action = actions[s][position[s]]
                at = ready_at(s, action)
                if at is not None and at <= now + 1e-12:
                    running[s], remaining[s], started[s] = action, duration(s, action), now
                    if action.phase is Phase.FORWARD:
                        forward_started[(action.stage_on(s), action.microbatch)] = now
        active = [s for s in range(P) if running[s] is not None]
        if not active and all(position[s] == len(actions[s]) for s in range(P)):
            break
        rates = {s: sharing.rate(s, active) for s in active}
        candidates = [now + remaining[s] / rates[s] for s in active]
        for s in range(P):
            if running[s] is None and position[s] < len(actions[s]):
                at = ready_at(s, actions[s][position[s]])
                if at is not None and at > now:
                    candidates.append(at)
        if not candidates:
            raise RuntimeError("The simulated schedule deadlocks.")  # dry_run-checked schedules never do
        step = min(candidates) - now
        now += step
        for s in active:
            remaining[s] -= step * rates[s]
            if remaining[s] <= 1e-12:
                done = running[s]
                assert done is not None
                spans.append(Span(s, done, started[s], now))
                running[s], free_at[s] = None, now
                position[s] += 1
                finished[(done.stage_on(s), done.phase, done.microbatch)] = now
    return spans, free_at


def _results_shared(ends: list[float], last_rank: int, post_s: float, broadcast_s: float) -> float:
    """When every rank is done with the step's results (its output and logged values), each having finished its
    part of the pipeline at ``ends``: the last stage's rank works on them for ``post_s`` and sends them; each other
    rank receives them once its own part is done (it posts the receive then: ``broadcast_s``) and works on them as
    long. A last stage that finishes last (a deferred weight pass: zero-bubble) thus makes the others wait twice
    ``post_s``."""
    sent = ends[last_rank] + post_s
    others = [max(end, sent) + broadcast_s + post_s for rank, end in enumerate(ends) if rank != last_rank]
    return max([sent, *others])


def _peak_activations(actions: list[Action], rank: int, stages: list[_Stage]) -> int:
    """The most activation bytes ``rank``'s ``actions`` keep at once, over its stages."""
    recomputed = {(a.stage_on(rank), a.microbatch) for a in actions if a.phase is Phase.RECOMPUTE}
    split = {(a.stage_on(rank), a.microbatch) for a in actions if a.phase is Phase.WEIGHT}  # alive until the W
    alive = peak = 0
    for a in actions:
        key = (a.stage_on(rank), a.microbatch)
        stage = stages[key[0]]
        if a.phase is Phase.FORWARD:
            alive += stage.input_bytes if key in recomputed else stage.activation_bytes
        elif a.phase is Phase.RECOMPUTE:
            alive += stage.activation_bytes
        elif (a.phase is Phase.BACKWARD) == (key in split):
            continue
        else:
            alive -= stage.activation_bytes + (stage.input_bytes if key in recomputed else 0)
        peak = max(peak, alive)
    return peak


def _stage_parameters(profile: ModelProfile, segments: list[int]) -> int:
    merged: dict[str, int] = {}
    for i in segments:
        merged.update(profile.segments[i].parameters)
    return sum(merged.values())


def _p2p(profile: ModelProfile, processes: int) -> Callable[[float], float]:
    if not profile.p2p:
        raise MissingMeasurement(
            "the profile has no point-to-point times between stages; profile with `--devices` 2 or more."
        )
    return profile.p2p.get(processes) or profile.p2p[min(profile.p2p, key=lambda n: abs(n - processes))]


def _no_transfer(nbytes: float) -> float:
    return 0.0


def _allreduce(profile: ModelProfile, processes: int, width: int) -> LinearCost:
    """The all-reduce cost of groups of ``width`` measured with ``processes`` running (else the nearest count)."""
    options = [(n, by_width[width]) for n, by_width in profile.allreduce.items() if width in by_width]
    if not options:
        raise MissingMeasurement(
            f"the profile has no all-reduce time for groups of {width} processes; profile the network with a "
            f"multiple of {width} processes on one node (`lightning-varuna profile --devices {width}`)."
        )
    return min(options, key=lambda item: abs(item[0] - processes))[1]


def _object_broadcast(profile: ModelProfile, processes: int, width: int) -> float:
    options = [(n, d, s) for n, by_width in profile.object_broadcast.items() for d, s in by_width.items()]
    if not options:
        return 0.0
    return min(options, key=lambda item: (abs(item[1] - width), abs(item[0] - processes)))[2]


def _tied_parameters(profile: ModelProfile, segments_of: list[list[int]]) -> dict[str, set[int]]:
    """Parameters held by more than one rank (``segments_of``: each rank's segments), and by which."""
    holders: dict[str, set[int]] = {}
    for rank, segments in enumerate(segments_of):
        for i in segments:
            for name in profile.segments[i].parameters:
                holders.setdefault(name, set()).add(rank)
    return {name: ranks for name, ranks in holders.items() if len(ranks) > 1}


def _parameter_bytes(profile: ModelProfile, name: str) -> int:
    return next(s.parameters[name] for s in profile.segments if name in s.parameters)
