"""Pipeline schedules as data: per-stage lists of actions, plus a dry run that checks them.

An action is a forward (``F``), recompute (``R``) or backward (``B``) of one micro-batch and prints as ``F3`` /
``R1`` / ``B0``. A schedule is one action list per stage. Generators produce schedules; one runtime executes any
of them. A stage that recomputes a micro-batch runs its forward without keeping activations (only its inputs) and
runs it again, keeping them, at the ``R`` action before the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "SCHEDULES",
    "Action",
    "Phase",
    "Schedule",
    "ScheduleError",
    "dry_run",
    "format_grid",
    "forward_only",
    "gpipe",
    "microbatches_of",
    "one_f_one_b",
    "varuna",
]


class Phase(str, Enum):
    FORWARD = "F"
    RECOMPUTE = "R"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    phase: Phase
    microbatch: int

    def __str__(self) -> str:
        return f"{self.phase.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        return cls(Phase(text[0]), int(text[1:]))


Schedule = list[list[Action]]


class ScheduleError(RuntimeError):
    """A schedule that cannot run to completion."""


def microbatches_of(actions: Sequence[Action], phase: Phase) -> set[int]:
    """The micro-batches that ``actions`` run ``phase`` for."""
    return {a.microbatch for a in actions if a.phase is phase}


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Forwards only, in micro-batch order (validation, test, predict)."""
    return [[Action(Phase.FORWARD, m) for m in range(num_microbatches)] for _ in range(num_stages)]


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
    duration = {Phase.FORWARD: 1, Phase.RECOMPUTE: 1, Phase.BACKWARD: 2}
    started: dict[tuple[int, Phase, int], int] = {}
    finished: dict[tuple[int, Phase, int], int] = {}
    schedule: Schedule = [[] for _ in range(num_stages)]
    free_at = [0] * num_stages
    next_forward = [0] * num_stages

    def done(stage: int, phase: Phase, m: int, now: int) -> bool:
        return finished.get((stage, phase, m), now + 1) <= now

    def begun(stage: int, phase: Phase, m: int, now: int) -> bool:
        return started.get((stage, phase, m), now + 1) <= now

    def candidates(stage: int, now: int) -> list[Action]:
        ran = {(a.phase, a.microbatch) for a in schedule[stage]}
        found = []
        for m in range(num_microbatches):
            if (Phase.BACKWARD, m) in ran:
                continue
            if stage == last:
                ready = done(stage, Phase.FORWARD, m, now)
            else:
                ready = done(stage, Phase.RECOMPUTE, m, now) and done(stage + 1, Phase.BACKWARD, m, now)
            if ready:
                found.append(Action(Phase.BACKWARD, m))
        for m in range(num_microbatches if stage < last else 0):
            recomputable = (Phase.RECOMPUTE, m) not in ran and done(stage, Phase.FORWARD, m, now)
            if recomputable and begun(stage + 1, Phase.BACKWARD, m, now):
                found.append(Action(Phase.RECOMPUTE, m))
        m = next_forward[stage]
        if m < num_microbatches and (stage == 0 or done(stage - 1, Phase.FORWARD, m, now)):
            found.append(Action(Phase.FORWARD, m))
        return found

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


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"1f1b": one_f_one_b, "gpipe": gpipe, "varuna": varuna}


def _chain(num_stages: int) -> dict[int, set[int]]:
    return {s: ({s - 1} if s else set()) for s in range(num_stages)}


def dry_run(schedule: Schedule, producers: Mapping[int, set[int]] | None = None) -> list[list[Action | None]]:
    """Execute ``schedule`` without a device and return the grid of ticks x stages.

    A forward of stage ``s`` waits for the same micro-batch's forward on each of its ``producers`` (default:
    the previous stage); a recompute waits for its forward; a backward waits for its own forward (or recompute)
    and for the backwards of the stages it feeds.

    Raises:
        ScheduleError: the schedule deadlocks or is incomplete; the message shows the grid so far.
    """
    num_stages = len(schedule)
    producers = producers if producers is not None else _chain(num_stages)
    consumers = {s: {c for c, ps in producers.items() if s in ps} for s in range(num_stages)}
    done: set[tuple[int, Phase, int]] = set()
    position = [0] * num_stages
    grid: list[list[Action | None]] = []

    recomputed = [microbatches_of(actions, Phase.RECOMPUTE) for actions in schedule]

    def ready(stage: int, action: Action) -> bool:
        m = action.microbatch
        if action.phase is Phase.FORWARD:
            return all((p, Phase.FORWARD, m) in done for p in producers[stage])
        if action.phase is Phase.RECOMPUTE:
            return (stage, Phase.FORWARD, m) in done
        activations = Phase.RECOMPUTE if m in recomputed[stage] else Phase.FORWARD
        return (stage, activations, m) in done and all((c, Phase.BACKWARD, m) in done for c in consumers[stage])

    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        tick: list[Action | None] = [None] * num_stages
        for stage in range(num_stages):
            if position[stage] < len(schedule[stage]) and ready(stage, schedule[stage][position[stage]]):
                tick[stage] = schedule[stage][position[stage]]
        if not any(tick):
            stuck = [
                str(schedule[s][position[s]]) if position[s] < len(schedule[s]) else "-" for s in range(num_stages)
            ]
            raise ScheduleError(f"Schedule deadlocks; next action per stage: {stuck}\n{format_grid(grid)}")
        for stage, action in enumerate(tick):
            if action is not None:
                done.add((stage, action.phase, action.microbatch))
                position[stage] += 1
        grid.append(tick)
    _check_complete(schedule)
    return grid


def _check_complete(schedule: Sequence[Sequence[Action]]) -> None:
    expected = microbatches_of(schedule[0], Phase.FORWARD) if schedule else set()
    for stage, actions in enumerate(schedule):
        if len(set(actions)) != len(actions):
            repeated = sorted({str(a) for a in actions if actions.count(a) > 1})
            raise ScheduleError(f"Stage {stage} runs {repeated} more than once.")
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
    """Render a tick x stage grid, one row per stage."""
    if not grid:
        return "(no action ran)"
    rows = []
    for stage in range(len(grid[0])):
        cells = [str(tick[stage]) if tick[stage] is not None else "." for tick in grid]
        rows.append(f"stage {stage}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(rows)
