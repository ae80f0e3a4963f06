"""Assign contiguous segments to pipeline stages so that the slowest stage is as fast as possible."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_stages"]


def balance_stages(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split segments ``0..len(costs)-1`` into ``num_stages`` contiguous, non-empty runs.

    Minimises the largest per-stage cost (ties: the smaller sum of squares, i.e. the more even split).

    Returns:
        The index of the first segment of each stage, starting with 0.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"Cannot cut {n} segment(s) into {num_stages} pipeline stages: each stage needs at least one "
            f"segment. Use `pipeline_parallel_size` <= {n}, or add more `CutPoint`s to the model."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + max(c, 0.0))

    def span(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    inf = (float("inf"), float("inf"))
    # best[k][j]: (max stage cost, sum of squares) of splitting segments [0, j) into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == inf:
                    continue
                cost = span(i, j)
                cand = (max(prev[0], cost), prev[1] + cost * cost)
                if cand < best[k][j]:
                    best[k][j], choice[k][j] = cand, i
    starts, j = [], n
    for k in range(num_stages, 0, -1):
        j = choice[k][j]
        starts.append(j)
    return starts[::-1]
