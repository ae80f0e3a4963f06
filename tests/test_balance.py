"""`balance_stages`: contiguous, non-empty stages that minimise the slowest stage."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_varuna.partition.balance import balance_stages


def stage_costs(costs: list[float], starts: list[int]) -> list[float]:
    ends = [*starts[1:], len(costs)]
    return [sum(costs[a:b]) for a, b in zip(starts, ends)]


def all_splits(num_segments: int, num_stages: int):
    for cuts in itertools.combinations(range(1, num_segments), num_stages - 1):
        yield [0, *cuts]


def assert_valid_split(starts: list[int], num_segments: int, num_stages: int) -> None:
    assert len(starts) == num_stages
    assert starts[0] == 0
    assert all(a < b for a, b in zip(starts, starts[1:])), "stages must be non-empty and in order"
    assert starts[-1] < num_segments, "the last stage must be non-empty"


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_costs(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    costs = [rng.uniform(0.0, 10.0) for _ in range(n)]
    for k in range(1, n + 1):
        starts = balance_stages(costs, k)
        assert_valid_split(starts, n, k)
        best = min(max(stage_costs(costs, s)) for s in all_splits(n, k))
        assert max(stage_costs(costs, starts)) == pytest.approx(best, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_with_tie_break_on_integer_costs(seed):
    # Integer costs keep every sum exact, so the (max, sum of squares) objective can be compared exactly.
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 9)
    costs = [float(rng.randint(0, 6)) for _ in range(n)]
    for k in range(1, n + 1):
        starts = balance_stages(costs, k)
        assert_valid_split(starts, n, k)

        def key(s):
            per_stage = stage_costs(costs, s)
            return max(per_stage), sum(c * c for c in per_stage)

        assert key(starts) == min(key(s) for s in all_splits(n, k))


def test_examples():
    assert balance_stages([1.0, 1.0, 1.0, 1.0], 2) == [0, 2]
    assert balance_stages([4.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1]
    assert balance_stages([1.0, 1.0, 1.0, 1.0, 4.0], 2) == [0, 4]
    assert balance_stages([1.0, 2.0, 3.0], 3) == [0, 1, 2]
    assert balance_stages([5.0], 1) == [0]
    # A single stage takes everything; as many stages as segments gives one segment each.
    assert balance_stages([3.0, 1.0, 2.0], 1) == [0]
    assert balance_stages([0.0, 0.0, 0.0, 0.0], 4) == [0, 1, 2, 3]


def test_all_zero_costs_still_give_non_empty_stages():
    for n in range(1, 7):
        for k in range(1, n + 1):
            assert_valid_split(balance_stages([0.0] * n, k), n, k)


def test_negative_costs_still_give_a_valid_split():
    # Timing noise can produce tiny negative numbers; they must not break the split.
    starts = balance_stages([-1e-6, 2.0, -3.0, 1.0], 2)
    assert_valid_split(starts, 4, 2)


@pytest.mark.parametrize(("num_segments", "num_stages"), [(3, 4), (1, 2), (0, 1), (3, 0), (2, -1)])
def test_impossible_stage_counts_raise(num_segments, num_stages):
    with pytest.raises(ValueError, match="pipeline_parallel_size") as excinfo:
        balance_stages([1.0] * num_segments, num_stages)
    message = str(excinfo.value)
    assert f"{num_segments} segment(s)" in message
    assert f"{num_stages} pipeline stages" in message
