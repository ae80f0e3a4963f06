"""Pipeline schedules as data: per-rank lists of actions, plus a dry run that checks them.

An action is a forward (``F``), recompute (``R``), backward (``B``) or weight pass (``W``) of one micro-batch and
prints as ``F3`` / ``R1`` / ``B0`` / ``W0``. A schedule is one action list per rank of the pipeline; with one stage per
rank, rank ``r`` runs stage ``r``. A rank that holds several (virtual) stages (interleaved) names the stage of each
action, printed in front: ``2F3`` is stage 2's forward of micro-batch 3. Generators produce schedules; one loop (the
step's, in `pipeline.step`) executes any of them. A stage that recomputes a micro-batch runs its forward
without keeping activations (only its inputs) and runs it again, keeping them, at the ``R`` action before the backward.
A stage whose list has a ``W`` for a micro-batch splits that backward in two: the ``B`` computes only the gradients
of the stage's inputs (which the previous stage waits for), and the ``W`` computes the parameters' gradients later,
where the stage would otherwise wait (zero-bubble).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "INTERLEAVED",
    "SCHEDULES",
    "Action",
    "Phase",
    "Schedule",
    "ScheduleError",
    "Work",
    "chain",
    "consumers_of",
    "dependencies",
    "dry_run",
    "format_grid",
    "forward_only",
    "gpipe",
    "interleaved_one_f_one_b",
    "make_schedule",
    "microbatches_of",
    "one_f_one_b",
    "rank_of_stage",
    "splits_into_rounds",
    "stages_of_rank",
    "varuna",
    "zbv",
    "zero_bubble",
]


class Phase(str, Enum):
    FORWARD = "F"
    RECOMPUTE = "R"
    BACKWARD = "B"
    WEIGHT = "W"  # the parameters' gradients of a backward whose ``B`` computed only its inputs' gradients


@dataclass(frozen=True)
class Action:
    phase: Phase
    microbatch: int
    stage: int | None = None
    """The stage that runs it, on a rank that holds several (interleaved); None: the rank's one stage."""

    def __str__(self) -> str:
        stage = "" if self.stage is None else str(self.stage)
        return f"{stage}{self.phase.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        digits = len(text) - len(text.lstrip("0123456789"))
        stage = int(text[:digits]) if digits else None
        return cls(Phase(text[digits]), int(text[digits + 1 :]), stage)

    def stage_on(self, rank: int) -> int:
        """The stage this action runs on when rank ``rank`` of the pipeline runs it."""
        return rank if self.stage is None else self.stage


Schedule = list[list[Action]]


class ScheduleError(RuntimeError):
    """A schedule that cannot run to completion."""


Work = tuple[int, Phase, int]  # (stage, phase, micro-batch): one action of one stage


def dependencies(
    stage: int,
    action: Action,
    producers: Mapping[int, set[int]],
    consumers: Mapping[int, set[int]],
    recomputes: bool,
) -> list[Work]:
    """The work that must have finished before ``stage`` may run ``action``: the one rule of the dry run, the
    Varuna generator and the simulator.

    A forward needs the same micro-batch's forward on each of its ``producers``; a recompute needs its own forward
    (whose inputs it reruns); a backward needs the stage's activations (its forward, or its recompute when the stage
    ``recomputes`` that micro-batch) and the backwards of the stages it feeds (``consumers``), whose gradients it
    receives; a weight pass needs the same micro-batch's backward on its stage (the input-gradient part it completes).
    """
    m = action.microbatch
    if action.phase is Phase.FORWARD:
        return [(p, Phase.FORWARD, m) for p in sorted(producers[stage])]
    if action.phase is Phase.RECOMPUTE:
        return [(stage, Phase.FORWARD, m)]
    if action.phase is Phase.WEIGHT:
        return [(stage, Phase.BACKWARD, m)]
    activations = (stage, Phase.RECOMPUTE if recomputes else Phase.FORWARD, m)
    return [activations, *((c, Phase.BACKWARD, m) for c in sorted(consumers[stage]))]


def chain(num_stages: int) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Producers and consumers of each stage of a plain pipeline: stage ``s`` feeds ``s + 1``."""
    producers = {s: ({s - 1} if s else set()) for s in range(num_stages)}
    return producers, consumers_of(producers)


def consumers_of(producers: Mapping[int, set[int]]) -> dict[int, set[int]]:
    return {s: {c for c, ps in producers.items() if s in ps} for s in producers}


def microbatches_of(actions: Sequence[Action], phase: Phase) -> set[int]:
    """The micro-batches that ``actions`` run ``phase`` for."""
    return {a.microbatch for a in actions if a.phase is phase}


def stages_of_rank(rank: int, num_ranks: int, stages_per_rank: int, v_shape: bool = False) -> tuple[int, ...]:
    """The stages pipeline position ``rank`` of ``num_ranks`` holds, in order: round-robin (``rank``, ``rank + P``,
    ...), or, ``v_shape`` (two per rank), ``rank`` and ``2P - 1 - rank``: the first and the last stage on position 0."""
    if v_shape:
        return (rank, 2 * num_ranks - 1 - rank)
    return tuple(rank + k * num_ranks for k in range(stages_per_rank))


def rank_of_stage(stage: int, num_ranks: int, v_shape: bool = False) -> int:
    """The pipeline position that holds ``stage`` (see `stages_of_rank`)."""
    if v_shape and stage >= num_ranks:
        return 2 * num_ranks - 1 - stage
    return stage % num_ranks


def forward_only(num_stages: int, num_microbatches: int, stages_per_rank: int = 1, v_shape: bool = False) -> Schedule:
    """Forwards only, in micro-batch order (validation, test, predict). With several stages per rank
    (``num_stages`` ranks), a rank runs every micro-batch through one of its stages, then through the next."""
    if stages_per_rank == 1:
        return [[Action(Phase.FORWARD, m) for m in range(num_microbatches)] for _ in range(num_stages)]
    return [
        [
            Action(Phase.FORWARD, m, stage)
            for stage in stages_of_rank(rank, num_stages, stages_per_rank, v_shape)
            for m in range(num_microbatches)
        ]
        for rank in range(num_stages)
    ]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe): simple, keeps every micro-batch's activations."""
    return [
        [Action(Phase.FORWARD, m) for m in range(num_microbatches)]
        + [Action(Phase.BACKWARD, m) for m in range(num_microbatches)]
        for _ in range(num_stages)
    ]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: a warm-up of forwards, then alternate one forward and one backward, then drain backwards.

    Stage ``s`` keeps at most ``num_stages - s`` micro-batches' activations alive.
    """
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_microbatches)
        actions = [Action(Phase.FORWARD, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions += [Action(Phase.FORWARD, warmup + i), Action(Phase.BACKWARD, i)]
        actions += [Action(Phase.BACKWARD, m) for m in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule


def zero_bubble(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), one stage per rank: 1F1B whose
    backwards compute only the inputs' gradients, each followed by a weight pass (``W``) of an earlier micro-batch.

    The gradient that the previous stage waits for leaves after about half a backward, and the weight passes fill the
    time a stage would wait. Stage ``s`` runs its first ``s`` backwards without a weight pass (the later a stage, the
    longer the previous ones wait on its first gradients) and catches up on the deferred weight passes at the end,
    where 1F1B leaves its drain bubble. Every stage keeps at most ``num_stages`` micro-batches' activations alive (a
    micro-batch's forward ran, its weight pass not yet): 1F1B's peak, which its first stage reaches; the stages after
    the first keep up to ``s`` more than under 1F1B. The order is torch's ``ScheduleInterleavedZeroBubble`` at one
    stage per rank.
    """
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_microbatches)
        actions = [Action(Phase.FORWARD, m) for m in range(warmup)]
        for m in range(num_microbatches):
            if warmup + m < num_microbatches:
                actions.append(Action(Phase.FORWARD, warmup + m))
            actions.append(Action(Phase.BACKWARD, m))
            if m >= stage:  # the weight passes run in micro-batch order, the first ``stage`` of them deferred
                actions.append(Action(Phase.WEIGHT, m - stage))
        actions += [Action(Phase.WEIGHT, m) for m in range(max(num_microbatches - stage, 0), num_microbatches)]
        schedule.append(actions)
    return schedule


def varuna(num_stages: int, num_microbatches: int) -> Schedule:
    """Varuna's schedule: every stage but the last recomputes its forward just before the backward.

    The order is what Varuna's rules give when a forward or a recompute takes one unit of time and a backward
    two: a stage runs a backward as soon as it can, else a recompute, else the next forward (so forwards fill
    the time a stage waits for a gradient). Stage ``s``'s recompute of a micro-batch becomes possible when
    stage ``s + 1`` starts that micro-batch's backward, so it overlaps the backward it waits for. Non-last
    stages keep only the inputs of the micro-batches in flight; each stage holds the activations of at most
    one micro-batch at a time.
    """
    last = num_stages - 1
    producers, consumers = chain(num_stages)
    duration = {Phase.FORWARD: 1, Phase.RECOMPUTE: 1, Phase.BACKWARD: 2}
    started: dict[Work, int] = {}
    finished: dict[Work, int] = {}
    schedule: Schedule = [[] for _ in range(num_stages)]
    free_at = [0] * num_stages
    next_forward = [0] * num_stages

    def runnable(stage: int, action: Action, now: int) -> bool:
        needs = dependencies(stage, action, producers, consumers, recomputes=stage < last)
        return all(finished.get(work, now + 1) <= now for work in needs)

    def candidates(stage: int, now: int) -> list[Action]:
        ran = set(schedule[stage])
        backwards = [Action(Phase.BACKWARD, m) for m in range(num_microbatches)]
        # Varuna's policy: recompute once the next stage has begun this micro-batch's backward, so the two overlap.
        recomputes = [
            Action(Phase.RECOMPUTE, m)
            for m in range(num_microbatches if stage < last else 0)
            if started.get((stage + 1, Phase.BACKWARD, m), now + 1) <= now
        ]
        forwards = [Action(Phase.FORWARD, next_forward[stage])] if next_forward[stage] < num_microbatches else []
        return [a for a in backwards + recomputes + forwards if a not in ran and runnable(stage, a, now)]

    now, total = 0, num_stages * num_microbatches * 2 + last * num_microbatches
    while len(finished) < total:
        for stage in reversed(range(num_stages)):  # a backward that starts now frees the recompute below it
            if free_at[stage] > now:
                continue
            ready = candidates(stage, now)
            if not ready:
                continue
            action = ready[0]
            key = (stage, action.phase, action.microbatch)
            started[key], finished[key] = now, now + duration[action.phase]
            free_at[stage] = finished[key]
            next_forward[stage] += action.phase is Phase.FORWARD
            schedule[stage].append(action)
        now += 1
    return schedule


def interleaved_one_f_one_b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", 2021): ``stages_per_rank`` stages per rank, round-robin (stage ``s`` on rank ``s % num_ranks``),
    one forward and one backward in turn in the steady state; a rank runs the micro-batches in rounds, each round's
    micro-batches through one of its stages and then the next ("depth first"). The order of torch's
    ``ScheduleInterleaved1F1B`` (its rounds of ``max(1, M // P)``, M micro-batches on P ranks): a stage is smaller, so
    the bubble shrinks to about 1 / ``stages_per_rank`` of 1F1B's, for more messages and more activations in flight.

    Raises:
        ValueError: ``num_microbatches`` does not split into the rounds (a multiple of ``max(1, M // P)``).
    """
    P, V, M = num_ranks, stages_per_rank, num_microbatches
    rounds = max(1, M // P)
    if not splits_into_rounds(P, M):
        fits = [m for m in range(1, 4 * P + 1) if splits_into_rounds(P, m)]
        raise ValueError(
            f"The interleaved 1F1B schedule runs a batch's micro-batches in rounds of M // rounds (rounds = "
            f"max(1, M // P), as torch's ScheduleInterleaved1F1B): {M} micro-batches on {P} ranks make {rounds} "
            f"rounds, which do not divide them. Choose `micro_batch_size` so that every batch (the last of an epoch "
            f"too, or drop it with `drop_last=True`) splits into a number of micro-batches such as {fits}."
        )
    per_round = M // rounds
    schedule: Schedule = []
    for rank in range(P):
        warmup = min((V - 1) * per_round + 2 * (P - 1 - rank), M * V)
        forwards: dict[int, int] = {}
        backwards: dict[int, int] = {}
        actions = []
        for op in range(M * V + warmup):
            if op < M * V:  # the warm-up's forwards, then one forward and one backward in turn
                stage = (op // per_round) % V * P + rank
                forwards[stage] = forwards.get(stage, -1) + 1
                actions.append(Action(Phase.FORWARD, forwards[stage], stage))
            if op >= warmup:  # then the backwards, the last stage's round first
                stage = (V - 1 - (op - warmup) // per_round % V) * P + rank
                backwards[stage] = backwards.get(stage, -1) + 1
                actions.append(Action(Phase.BACKWARD, backwards[stage], stage))
        schedule.append(actions)
    return schedule


def zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """ZBV zero-bubble (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two stages per rank in a
    V (`stages_of_rank` with ``v_shape``: position 0 holds the first and the last stage, so a tied embedding and LM
    head share one tensor), every backward split into its input-gradient part and a weight pass that fills the
    bubble. The order of torch's ``ScheduleZBVZeroBubble``: a warm-up of forwards down the V and back, a steady state
    of a forward, backward and weight pass of each of the rank's stages in turn, and a cool-down that defers weight
    passes to the end.

    Raises:
        ValueError: ``stages_per_rank`` is not 2.
    """
    if stages_per_rank != 2:
        raise ValueError(f"The ZBV schedule runs exactly 2 stages per rank (a V), not {stages_per_rank}.")
    return [_zbv_rank(rank, num_ranks, num_microbatches) for rank in range(num_ranks)]


def _zbv_rank(rank: int, P: int, M: int) -> list[Action]:
    """Pipeline position ``rank``'s actions under `zbv` (torch's ``_calculate_single_rank_operations``)."""
    first, second = stages_of_rank(rank, P, 2, v_shape=True)
    done: Counter[tuple[int, Phase]] = Counter()
    actions: list[Action] = []

    def run(stage: int, *phases: Phase) -> None:
        for phase in phases:
            actions.append(Action(phase, done[(stage, phase)], stage))
            done[(stage, phase)] += 1

    F, B, W = Phase.FORWARD, Phase.BACKWARD, Phase.WEIGHT
    n_micro = max(2 * P - 1, M)  # as torch: enough micro-batches to fill the V; the extra ones are dropped below
    for _ in range(2 * (P - rank) - 1):
        run(first, F)
    for _ in range(rank):
        run(second, F)
        run(first, F)
    for _ in range(P - rank):
        run(second, F, B, W)
    while done[(second, F)] < done[(first, F)] or done[(first, F)] < n_micro:
        if done[(first, F)] < n_micro:
            run(first, F)
        run(first, B, W)
        run(second, F, B, W)
    for _ in range(rank):
        run(first, B)
        run(second, B)
    for _ in range(P - rank):
        run(first, B)
        run(first, W)
    while done[(second, W)] < done[(second, B)]:
        run(second, W)
    while done[(first, W)] < done[(first, B)]:
        run(first, W)
    return [a for a in actions if a.microbatch < M]


def splits_into_rounds(num_ranks: int, num_microbatches: int) -> bool:
    """Whether `interleaved_one_f_one_b` can run ``num_microbatches`` on ``num_ranks`` ranks: its rounds of
    ``M // rounds`` micro-batches (rounds = ``max(1, M // P)``, as torch's) must divide them."""
    return num_microbatches % max(1, num_microbatches // num_ranks) == 0


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "varuna": varuna,
    "zero-bubble": zero_bubble,
}
"""The schedules of one stage per rank, by name: ``generator(num_stages, num_microbatches)``."""

INTERLEAVED: dict[str, Callable[[int, int, int], Schedule]] = {"interleaved-1f1b": interleaved_one_f_one_b, "zbv": zbv}
"""The schedules of several stages per rank, by name: ``generator(num_ranks, num_microbatches, stages_per_rank)``."""

V_SHAPED = frozenset({"zbv"})
"""The schedules whose ranks hold their stages in a V (`stages_of_rank`), not round-robin."""


def make_schedule(
    name: str | None, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1, v_shape: bool = False
) -> Schedule:
    """The schedule ``name`` (of `SCHEDULES` or `INTERLEAVED`; None: forwards only, on stages placed in a V if
    ``v_shape``) of a pipeline of ``num_ranks`` ranks holding ``stages_per_rank`` stages each, one action list per
    rank."""
    if name is None:
        return forward_only(num_ranks, num_microbatches, stages_per_rank, v_shape)
    if name in INTERLEAVED:
        return INTERLEAVED[name](num_ranks, num_microbatches, stages_per_rank)
    if stages_per_rank != 1:
        raise ValueError(f"The schedule {name!r} runs one stage per rank, not {stages_per_rank}.")
    return SCHEDULES[name](num_ranks, num_microbatches)


def dry_run(schedule: Schedule, producers: Mapping[int, set[int]] | None = None) -> list[list[Action | None]]:
    """Execute ``schedule`` without a device and return the grid of ticks x ranks (with one stage per rank: stages).

    A forward of stage ``s`` waits for the same micro-batch's forward on each of its ``producers`` (default:
    the previous stage); a recompute waits for its forward; a backward waits for its own forward (or recompute)
    and for the backwards of the stages it feeds; a weight pass waits for its backward. A rank runs its actions in
    order, whichever of its stages they belong to.

    Raises:
        ScheduleError: the schedule deadlocks or is incomplete; the message shows the grid so far.
    """
    num_ranks = len(schedule)
    num_stages = max([a.stage_on(r) + 1 for r, actions in enumerate(schedule) for a in actions] + [num_ranks])
    producers, consumers = chain(num_stages) if producers is None else (producers, consumers_of(producers))
    done: set[Work] = set()
    position = [0] * num_ranks
    grid: list[list[Action | None]] = []
    by_stage = _actions_by_stage(schedule, num_stages)
    where = "Rank" if num_stages > num_ranks else "Stage"  # the grid's rows
    recomputed = [microbatches_of(actions, Phase.RECOMPUTE) for actions in by_stage]

    def ready(rank: int, action: Action) -> bool:
        stage = action.stage_on(rank)
        needs = dependencies(stage, action, producers, consumers, action.microbatch in recomputed[stage])
        return all(work in done for work in needs)

    while any(position[r] < len(schedule[r]) for r in range(num_ranks)):
        tick: list[Action | None] = [None] * num_ranks
        for rank in range(num_ranks):
            if position[rank] < len(schedule[rank]) and ready(rank, schedule[rank][position[rank]]):
                tick[rank] = schedule[rank][position[rank]]
        if not any(tick):
            stuck = [str(schedule[r][position[r]]) if position[r] < len(schedule[r]) else "-" for r in range(num_ranks)]
            raise ScheduleError(f"Schedule deadlocks; next action per {where.lower()}: {stuck}\n{format_grid(grid)}")
        for rank, action in enumerate(tick):
            if action is not None:
                done.add((action.stage_on(rank), action.phase, action.microbatch))
                position[rank] += 1
        grid.append(tick)
    for rank, actions in enumerate(schedule):
        if len(set(actions)) != len(actions):
            repeated = sorted({str(a) for a in actions if actions.count(a) > 1})
            raise ScheduleError(f"{where} {rank} runs {repeated} more than once.")
    _check_complete(by_stage)
    return grid


def _actions_by_stage(schedule: Schedule, num_stages: int) -> list[list[Action]]:
    """Each stage's actions, in its rank's order, without their stage."""
    by_stage: list[list[Action]] = [[] for _ in range(num_stages)]
    for rank, actions in enumerate(schedule):
        for a in actions:
            by_stage[a.stage_on(rank)].append(Action(a.phase, a.microbatch))
    return by_stage


def _check_complete(schedule: Sequence[Sequence[Action]]) -> None:
    expected = microbatches_of(schedule[0], Phase.FORWARD) if schedule else set()
    for stage, actions in enumerate(schedule):
        forwards = microbatches_of(actions, Phase.FORWARD)
        backwards = microbatches_of(actions, Phase.BACKWARD)
        if forwards != expected:
            raise ScheduleError(f"Stage {stage} runs forwards {sorted(forwards)} but stage 0 runs {sorted(expected)}.")
        if backwards and backwards != forwards:
            raise ScheduleError(f"Stage {stage} runs backwards {sorted(backwards)} for forwards {sorted(forwards)}.")
        recomputes = microbatches_of(actions, Phase.RECOMPUTE)
        if not recomputes <= backwards:
            missing = sorted(recomputes - backwards)
            raise ScheduleError(f"Stage {stage} recomputes {missing} but never runs their backward.")


def format_grid(grid: Sequence[Sequence[Action | None]]) -> str:
    """Render a tick x rank grid, one row per rank (a stage, with one stage per rank)."""
    if not grid:
        return "(no action ran)"
    rows = []
    interleaved = any(a is not None and a.stage is not None for tick in grid for a in tick)
    label, width = ("rank", 4) if interleaved else ("stage", 3)
    for rank in range(len(grid[0])):
        cells = [str(tick[rank]) if tick[rank] is not None else "." for tick in grid]
        rows.append(f"{label} {rank}: " + " ".join(f"{c:>{width}}" for c in cells))
    return "\n".join(rows)
