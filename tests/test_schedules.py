"""Pipeline schedules as data: generators, the dry run that checks them, and the grid it prints."""

from __future__ import annotations

import pytest

from lightning_varuna.pipeline.schedules import (
    SCHEDULES,
    Action,
    Phase,
    ScheduleError,
    dependencies,
    dry_run,
    format_grid,
    forward_only,
    gpipe,
    one_f_one_b,
    varuna,
    zero_bubble,
)

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 5), (3, 2), (4, 1), (4, 3), (4, 4), (4, 8), (5, 7)]
TRAINING = [gpipe, one_f_one_b, varuna, zero_bubble]
ALL = [forward_only, gpipe, one_f_one_b, varuna, zero_bubble]


def F(m: int) -> Action:  # noqa: N802
    return Action(Phase.FORWARD, m)


def B(m: int) -> Action:  # noqa: N802
    return Action(Phase.BACKWARD, m)


def R(m: int) -> Action:  # noqa: N802
    return Action(Phase.RECOMPUTE, m)


def W(m: int) -> Action:  # noqa: N802
    return Action(Phase.WEIGHT, m)


def parse_schedule(*stages: str) -> list[list[Action]]:
    return [[Action.parse(a) for a in stage.split()] for stage in stages]


def chain(num_stages: int) -> dict[int, set[int]]:
    return {s: ({s - 1} if s else set()) for s in range(num_stages)}


def assert_grid_respects_dependencies(schedule, grid, producers) -> None:
    """Every action of the schedule ran exactly once, in list order, after everything it depends on."""
    num_stages = len(schedule)
    consumers = {s: {c for c, ps in producers.items() if s in ps} for s in range(num_stages)}
    tick_of: dict[tuple[int, Action], int] = {}
    for t, tick in enumerate(grid):
        assert len(tick) == num_stages
        for stage, action in enumerate(tick):
            if action is not None:
                assert (stage, action) not in tick_of
                tick_of[(stage, action)] = t
    for stage, actions in enumerate(schedule):
        ran = [a for tick in grid for a in [tick[stage]] if a is not None]
        assert ran == actions, f"stage {stage} did not run its list in order"
    for (stage, action), t in tick_of.items():
        m = action.microbatch
        if action.phase is Phase.FORWARD:
            for p in producers[stage]:
                assert tick_of[(p, F(m))] < t
        elif action.phase is Phase.RECOMPUTE:
            assert tick_of[(stage, F(m))] < t
        elif action.phase is Phase.WEIGHT:
            assert tick_of[(stage, B(m))] < t
        else:
            assert tick_of[(stage, F(m))] < t
            if (stage, R(m)) in tick_of:
                assert tick_of[(stage, R(m))] < t
            for c in consumers[stage]:
                assert tick_of[(c, B(m))] < t


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose activations are alive at once (forward, or recompute if there is one, ran
    and backward, or its weight pass if there is one, not yet)."""
    recomputed = {a.microbatch for a in actions if a.phase is Phase.RECOMPUTE}
    deferred = {a.microbatch for a in actions if a.phase is Phase.WEIGHT}
    alive = peak = 0
    for action in actions:
        if action.phase is Phase.WEIGHT or (action.phase is Phase.BACKWARD and action.microbatch not in deferred):
            alive -= 1
        elif action.phase is Phase.BACKWARD:
            pass
        elif (action.phase is Phase.RECOMPUTE) == (action.microbatch in recomputed):
            alive += 1
        peak = max(peak, alive)
    return peak


def test_registry_names_the_training_schedules():
    assert sorted(SCHEDULES) == ["1f1b", "gpipe", "varuna", "zero-bubble"]
    assert SCHEDULES["1f1b"] is one_f_one_b
    assert SCHEDULES["gpipe"] is gpipe
    assert SCHEDULES["varuna"] is varuna
    assert SCHEDULES["zero-bubble"] is zero_bubble


@pytest.mark.parametrize("generator", ALL, ids=lambda g: g.__name__)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_generators_pass_the_dry_run(generator, num_stages, num_microbatches):
    schedule = generator(num_stages, num_microbatches)
    assert len(schedule) == num_stages
    grid = dry_run(schedule)
    assert_grid_respects_dependencies(schedule, grid, chain(num_stages))


@pytest.mark.parametrize("generator", TRAINING, ids=lambda g: g.__name__)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_every_stage_sends_and_receives_each_kind_of_message_in_microbatch_order(
    generator, num_stages, num_microbatches
):
    """NCCL runs the messages between two ranks of a process group in the order they were posted. Activations and
    gradients travel in groups of their own, so each stage must post each kind in the order its neighbour does:
    micro-batch order, for forwards and for backwards."""
    for actions in generator(num_stages, num_microbatches):
        for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.WEIGHT):
            order = [a.microbatch for a in actions if a.phase is phase]
            assert order == sorted(order), (phase, [str(a) for a in actions])


@pytest.mark.parametrize("generator", TRAINING, ids=lambda g: g.__name__)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_training_schedules_run_each_forward_and_backward_once(generator, num_stages, num_microbatches):
    for actions in generator(num_stages, num_microbatches):
        forwards = [a.microbatch for a in actions if a.phase is Phase.FORWARD]
        backwards = [a.microbatch for a in actions if a.phase is Phase.BACKWARD]
        recomputes = [a.microbatch for a in actions if a.phase is Phase.RECOMPUTE]
        weights = [a.microbatch for a in actions if a.phase is Phase.WEIGHT]
        assert sorted(forwards) == list(range(num_microbatches))
        assert sorted(backwards) == list(range(num_microbatches))
        assert len(actions) == 2 * num_microbatches + len(recomputes) + len(weights)
        # A micro-batch's backward never precedes its own forward (or recompute) within the stage's list, nor its
        # weight pass its backward.
        for m in range(num_microbatches):
            assert actions.index(F(m)) < actions.index(B(m))
            if m in recomputes:
                assert actions.index(F(m)) < actions.index(R(m)) < actions.index(B(m))
            if m in weights:
                assert actions.index(B(m)) < actions.index(W(m))


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_forward_only_runs_each_forward_once_in_order(num_stages, num_microbatches):
    schedule = forward_only(num_stages, num_microbatches)
    assert schedule == [[F(m) for m in range(num_microbatches)]] * num_stages
    # A forward-only chain fills the pipe: stage s runs micro-batch m at tick m + s.
    grid = dry_run(schedule)
    assert len(grid) == num_microbatches + num_stages - 1
    for stage in range(num_stages):
        for m in range(num_microbatches):
            assert grid[m + stage][stage] == F(m)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_one_f_one_b_bounds_activations_in_flight(num_stages, num_microbatches):
    for stage, actions in enumerate(one_f_one_b(num_stages, num_microbatches)):
        assert max_in_flight(actions) <= num_stages - stage
        assert max_in_flight(actions) == min(num_stages - stage, num_microbatches)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_gpipe_keeps_every_microbatch_in_flight(num_stages, num_microbatches):
    for actions in gpipe(num_stages, num_microbatches):
        assert max_in_flight(actions) == num_microbatches
        assert [a.phase for a in actions] == [Phase.FORWARD] * num_microbatches + [Phase.BACKWARD] * num_microbatches


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_varuna_recomputes_on_every_stage_but_the_last(num_stages, num_microbatches):
    schedule = varuna(num_stages, num_microbatches)
    for stage, actions in enumerate(schedule):
        recomputes = sorted(a.microbatch for a in actions if a.phase is Phase.RECOMPUTE)
        assert recomputes == ([] if stage == num_stages - 1 else list(range(num_microbatches)))
        # Only one micro-batch's activations are alive at a time; the others keep just their inputs.
        assert max_in_flight(actions) == 1
        # Forwards run in micro-batch order, so dropout draws the same random numbers as with 1F1B.
        assert [a.microbatch for a in actions if a.phase is Phase.FORWARD] == list(range(num_microbatches))


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_zero_bubble_splits_every_backward_within_one_f_one_b_peak_memory(num_stages, num_microbatches):
    """ZB-H1: every backward has its weight pass; every stage keeps at most the micro-batches 1F1B's first stage
    keeps (its peak), and stage ``s`` defers at most ``s`` weight passes beyond its 1F1B in-flight count."""
    for stage, actions in enumerate(zero_bubble(num_stages, num_microbatches)):
        assert sorted(a.microbatch for a in actions if a.phase is Phase.WEIGHT) == list(range(num_microbatches))
        assert max_in_flight(actions) <= min(num_stages, num_microbatches)
        assert max_in_flight(actions) <= min(num_stages - stage, num_microbatches) + stage
        # Without the weight passes, the order is 1F1B's.
        assert [a for a in actions if a.phase is not Phase.WEIGHT] == one_f_one_b(num_stages, num_microbatches)[stage]


def test_zero_bubble_shape_for_four_stages():
    """torch's ScheduleInterleavedZeroBubble at one stage per rank (ZB1P) gives these lists."""
    schedule = zero_bubble(4, 6)
    assert " ".join(map(str, schedule[0])) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    assert " ".join(map(str, schedule[3])) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"


def test_zero_bubble_leaves_a_third_of_one_f_one_b_bubble():
    """With a forward, an input-gradient part and a weight part of one tick each (a whole backward: two), the dry
    run's dependencies give 1F1B a bubble of 3 (P - 1) ticks and ZB-H1 of P - 1, as the paper computes."""
    durations = {Phase.FORWARD: 1, Phase.BACKWARD: 1, Phase.WEIGHT: 1}
    for num_stages, num_microbatches in [(2, 4), (4, 8), (4, 16)]:
        work = 3 * num_microbatches
        assert makespan(one_f_one_b(num_stages, num_microbatches), durations) == work + 3 * (num_stages - 1)
        assert makespan(zero_bubble(num_stages, num_microbatches), durations) == work + num_stages - 1


def makespan(schedule: list[list[Action]], durations: dict[Phase, int]) -> int:
    """When the last stage ends, each stage running its list as soon as the dry run's dependencies allow; a backward
    without a weight pass takes its weight pass's time too."""
    num_stages = len(schedule)
    producers = chain(num_stages)
    consumers = {s: {c for c, ps in producers.items() if s in ps} for s in range(num_stages)}
    finished: dict[tuple[int, Phase, int], int] = {}
    free = [0] * num_stages
    position = [0] * num_stages
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        ran = False
        for stage, actions in enumerate(schedule):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                needs = dependencies(stage, action, producers, consumers, recomputes=False)
                if any(work not in finished for work in needs):
                    break
                duration = durations[action.phase]
                if action.phase is Phase.BACKWARD and W(action.microbatch) not in actions:
                    duration += durations[Phase.WEIGHT]
                free[stage] = max([free[stage]] + [finished[work] for work in needs]) + duration
                finished[(stage, action.phase, action.microbatch)] = free[stage]
                position[stage] += 1
                ran = True
        assert ran
    return max(free)


@pytest.mark.parametrize("schedule", ["F0 W0 B0", "F0 B0 W0 F1 W1"])
def test_weight_pass_before_or_without_its_backward_deadlocks(schedule):
    with pytest.raises(ScheduleError, match=r"\['W"):
        dry_run(parse_schedule(schedule))


def test_varuna_recomputes_while_the_next_stage_runs_its_backward():
    grid = dry_run(varuna(3, 5))
    assert format_grid(grid) == (
        "stage 0:  F0  F1  F2  F3  F4  R0  B0  R1  B1  R2  B2  R3   .   .  B3  R4  B4\n"
        "stage 1:   .  F0  F1  R0  F2  B0  R1  B1  R2  B2  F3  F4  R3  B3  R4  B4   .\n"
        "stage 2:   .   .  F0  B0  F1  B1  F2  B2   .   .   .  F3  B3  F4  B4   .   ."
    )
    # Stage 1 fills the wait for B0's gradient with an opportunistic forward (R0 F2 B0).
    assert " ".join(map(str, varuna(3, 5)[1][:5])) == "F0 F1 R0 F2 B0"


def test_backward_before_its_recompute_deadlocks():
    with pytest.raises(ScheduleError, match=r"\['B0', '-'\]"):
        dry_run(parse_schedule("F0 B0 R0", "F0 B0"))


def test_recompute_without_backward_is_incomplete():
    with pytest.raises(ScheduleError, match=r"Stage 0 recomputes \[0\] but never runs their backward"):
        dry_run(parse_schedule("F0 R0"))


def test_one_f_one_b_shape_for_four_stages():
    schedule = one_f_one_b(4, 6)
    assert " ".join(map(str, schedule[0])) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert " ".join(map(str, schedule[3])) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"


@pytest.mark.parametrize("generator", ALL, ids=lambda g: g.__name__)
def test_action_str_parse_round_trip(generator):
    for actions in generator(3, 12):
        for action in actions:
            text = str(action)
            assert text == f"{action.phase.value}{action.microbatch}"
            assert Action.parse(text) == action
    assert str(B(12)) == "B12"
    assert Action.parse("F10") == F(10)


def test_action_parse_rejects_unknown_phase():
    with pytest.raises(ValueError):
        Action.parse("X1")


def test_format_grid():
    assert format_grid([]) == "(no action ran)"
    assert format_grid([[F(0), None], [F(1), F(0)], [None, B(10)]]) == "stage 0:  F0  F1   .\nstage 1:   .  F0 B10"


def test_swapped_forward_order_deadlocks_with_grid_in_message():
    # Stage 1 wants micro-batch 1 first; stage 0 waits for micro-batch 0's backward before producing it.
    schedule = parse_schedule("F0 B0 F1 B1", "F1 F0 B0 B1")
    with pytest.raises(ScheduleError) as excinfo:
        dry_run(schedule)
    message = str(excinfo.value)
    assert "deadlock" in message
    assert "['B0', 'F1']" in message
    assert format_grid([[F(0), None]]) in message


def test_waiting_for_backward_before_next_forward_deadlocks_with_grid_in_message():
    # Stage 0 wants B0 (needs stage 1's B0) before F1, but stage 1 wants F1 before B0.
    schedule = parse_schedule("F0 B0 F1 B1", "F0 F1 B0 B1")
    with pytest.raises(ScheduleError) as excinfo:
        dry_run(schedule)
    message = str(excinfo.value)
    assert "['B0', 'F1']" in message
    assert format_grid([[F(0), None], [None, F(0)]]) in message
    assert "stage 0:  F0   ." in message
    assert "stage 1:   .  F0" in message


def test_deadlock_before_any_action_says_so():
    with pytest.raises(ScheduleError, match=r"(?s)\['B0'\].*no action ran"):
        dry_run(parse_schedule("B0 F0"))


def test_backwards_not_matching_forwards_is_incomplete():
    with pytest.raises(ScheduleError, match=r"Stage 0 runs backwards \[0\] for forwards \[0, 1\]"):
        dry_run(parse_schedule("F0 F1 B0"))


def test_missing_backward_on_a_later_stage_deadlocks():
    # Stage 0's B1 waits for stage 1's B1, which never comes.
    with pytest.raises(ScheduleError):
        dry_run(parse_schedule("F0 F1 B0 B1", "F0 F1 B0"))


FAN_IN = {0: set(), 1: set(), 2: {0, 1}}  # stage 2 reads the outputs of stages 0 and 1
SKIP = {0: set(), 1: {0}, 2: {0, 1}}  # stage 0's output also skips stage 1 (TinyLM's mask)


@pytest.mark.parametrize("producers", [FAN_IN, SKIP], ids=["fan-in", "skip"])
@pytest.mark.parametrize("generator", ALL, ids=lambda g: g.__name__)
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 6])
def test_non_chain_producers(producers, generator, num_microbatches):
    schedule = generator(3, num_microbatches)
    grid = dry_run(schedule, producers)
    assert_grid_respects_dependencies(schedule, grid, producers)


def test_fan_in_lets_independent_stages_start_together():
    grid = dry_run(forward_only(3, 2), FAN_IN)
    # Stages 0 and 1 read only the model input, so they run side by side; stage 2 follows both.
    assert grid == [[F(0), F(0), None], [F(1), F(1), F(0)], [None, None, F(1)]]


def test_fan_in_deadlock_is_reported():
    # Stage 1 holds micro-batch 0 until micro-batch 1's backward, which needs stage 2, which needs stage 1's F0.
    schedule = parse_schedule("F0 B0 F1 B1", "F1 B1 F0 B0", "F0 B0 F1 B1")
    with pytest.raises(ScheduleError) as excinfo:
        dry_run(schedule, FAN_IN)
    assert format_grid([[F(0), F(1), None]]) in str(excinfo.value)
    # The same lists in a plain chain deadlock too (stage 1's F1 needs stage 0's F1).
    with pytest.raises(ScheduleError):
        dry_run(schedule)


def test_forward_only_missing_microbatch_on_consumer_is_incomplete():
    with pytest.raises(ScheduleError, match=r"Stage 1 runs forwards \[0\] but stage 0 runs \[0, 1\]"):
        dry_run(parse_schedule("F0 F1", "F0"))


def test_duplicate_action_is_rejected():
    with pytest.raises(ScheduleError, match=r"Stage 0 runs \['B0', 'F0'\] more than once"):
        dry_run(parse_schedule("F0 F0 B0 B0"))
