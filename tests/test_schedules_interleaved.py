"""The interleaved 1F1B schedule (several stages per rank) as data: torch's order, checked by the dry run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

from lightning_varuna.pipeline.schedules import (
    Action,
    Phase,
    ScheduleError,
    dry_run,
    format_grid,
    forward_only,
    interleaved_one_f_one_b,
    make_schedule,
    microbatches_of,
)

# (ranks, stages per rank, micro-batches) that split into torch's rounds
SHAPES = [(P, V, M) for P in (2, 3, 4) for V in (2, 3) for M in range(1, 3 * P + 1) if M % max(1, M // P) == 0]


def torch_order(P: int, V: int, M: int, rank: int) -> list[str]:
    """The actions torch's ``ScheduleInterleaved1F1B`` gives ``rank`` (its idle slots left out)."""
    rounds = max(1, M // P)
    schedule = SimpleNamespace(n_local_stages=V, microbatches_per_round=M // rounds, pp_group_size=P, _n_microbatches=M)
    return [str(a) for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank) if a is not None]


@pytest.mark.parametrize(("P", "V", "M"), SHAPES)
def test_interleaved_order_is_torch_and_passes_the_dry_run(P, V, M):
    schedule = interleaved_one_f_one_b(P, M, V)
    assert [[str(a) for a in actions] for actions in schedule] == [torch_order(P, V, M, r) for r in range(P)]
    dry_run(schedule)
    for rank, actions in enumerate(schedule):
        stages = {a.stage for a in actions}
        assert stages == {rank + k * P for k in range(V)}  # round-robin
        for stage in stages:  # every micro-batch's forward and backward, in micro-batch order
            own = [a for a in actions if a.stage == stage]
            assert [a.microbatch for a in own if a.phase is Phase.FORWARD] == list(range(M))
            assert [a.microbatch for a in own if a.phase is Phase.BACKWARD] == list(range(M))
    dry_run(forward_only(P, M, V))


def test_interleaved_grid_for_two_ranks():
    assert format_grid(dry_run(interleaved_one_f_one_b(2, 4, 2))) == (
        "rank 0:  0F0  0F1  2F0  2F1  0F2  2B0  0F3  2B1  2F2  0B0  2F3  0B1    .  2B2    .  2B3  0B2  0B3\n"
        "rank 1:    .  1F0  1F1  3F0  3B0  3F1  3B1  1F2  1B0  1F3  1B1  3F2  3B2  3F3  3B3  1B2  1B3    ."
    )


def test_an_action_names_its_stage_and_parses_back():
    action = Action(Phase.BACKWARD, 3, 12)
    assert str(action) == "12B3"
    assert Action.parse("12B3") == action
    assert Action.parse("B3") == Action(Phase.BACKWARD, 3)
    assert action.stage_on(0) == 12 and Action.parse("F0").stage_on(1) == 1


def test_micro_batches_that_do_not_split_into_rounds_are_refused():
    with pytest.raises(ValueError, match=r"5 micro-batches on 2 ranks make 2 rounds.*\[1, 2, 3, 4, 6, 8\]"):
        interleaved_one_f_one_b(2, 5, 2)


def test_one_stage_schedules_refuse_several_stages_per_rank():
    assert make_schedule("interleaved-1f1b", 2, 4, 2) == interleaved_one_f_one_b(2, 4, 2)
    assert make_schedule("1f1b", 2, 4) == make_schedule("1f1b", 2, 4, 1)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        make_schedule("1f1b", 2, 4, 2)


def test_dry_run_sees_a_stage_waiting_for_another_on_its_own_rank():
    """Rank 0 holds stages 0 and 2: its stage 2 cannot run a micro-batch before stage 1 (rank 1) sent it."""
    with pytest.raises(ScheduleError, match="deadlocks"):
        dry_run([[Action.parse(a) for a in ["2F0", "0F0"]], [Action.parse("1F0")]])
    grid = dry_run([[Action.parse(a) for a in ["0F0", "2F0"]], [Action.parse("1F0")]])
    assert len(grid) == 3
    assert microbatches_of([a for tick in grid for a in tick if a is not None], Phase.FORWARD) == {0}
