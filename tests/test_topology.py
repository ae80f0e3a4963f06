"""Rank arithmetic of a pipeline x data-parallel job (no process groups needed)."""

from __future__ import annotations

import pytest

from lightning_varuna.pipeline.topology import Topology

P, D = 2, 3


@pytest.mark.parametrize(
    ("rank", "pp_rank", "dp_rank"),
    [(0, 1, 0), (1, 0, 0), (2, 1, 1), (3, 0, 1), (4, 1, 2), (5, 0, 2)],
)
def test_ranks_of_p2_d3(rank, pp_rank, dp_rank):
    topo = Topology.from_world(P * D, rank, P, None)
    assert topo.data_parallel_size == D
    assert topo.pp_rank == pp_rank
    assert topo.dp_rank == dp_rank
    assert topo.is_last_stage == (pp_rank == P - 1)
    # The stages of one replica are neighbouring ranks, the last first (rank 0 holds replica 0's last stage); one
    # stage's replicas are P apart.
    assert topo.stage_ranks() == [2 * dp_rank + 1, 2 * dp_rank]
    assert topo.replica_ranks() == [1 - pp_rank, 3 - pp_rank, 5 - pp_rank]
    assert rank in topo.stage_ranks()
    assert rank in topo.replica_ranks()


def test_explicit_group_arguments():
    topo = Topology(pipeline_parallel_size=P, data_parallel_size=D, rank=0)
    assert [topo.stage_ranks(d) for d in range(D)] == [[1, 0], [3, 2], [5, 4]]
    assert [topo.replica_ranks(p) for p in range(P)] == [[1, 3, 5], [0, 2, 4]]


@pytest.mark.parametrize(("pp", "dp"), [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2), (4, 2)])
def test_groups_partition_the_world(pp, dp):
    world = pp * dp
    for rank in range(world):
        topo = Topology.from_world(world, rank, pp, dp)
        assert topo.stage_ranks()[topo.pp_rank] == rank
        assert topo.replica_ranks()[topo.dp_rank] == rank
    topo = Topology.from_world(world, 0, pp, None)
    stage_groups = [topo.stage_ranks(d) for d in range(dp)]
    replica_groups = [topo.replica_ranks(p) for p in range(pp)]
    assert sorted(r for g in stage_groups for r in g) == list(range(world))
    assert sorted(r for g in replica_groups for r in g) == list(range(world))
    # Every stage group meets every replica group in exactly one rank.
    for sg in stage_groups:
        for rg in replica_groups:
            assert len(set(sg) & set(rg)) == 1


def test_from_world_with_matching_explicit_data_parallel_size():
    assert Topology.from_world(6, 4, 2, 3) == Topology(2, 3, 4)


def test_world_not_a_multiple_of_pipeline_size():
    with pytest.raises(ValueError) as excinfo:
        Topology.from_world(6, 0, 4, None)
    message = str(excinfo.value)
    assert "world size 6" in message
    assert "pipeline_parallel_size=4" in message


@pytest.mark.parametrize("data_parallel_size", [2, 4, 1])
def test_explicit_data_parallel_size_must_match(data_parallel_size):
    with pytest.raises(ValueError) as excinfo:
        Topology.from_world(6, 0, 2, data_parallel_size)
    message = str(excinfo.value)
    assert "world size 6" in message
    assert f"2 x {data_parallel_size}" in message
    assert f"Launch {2 * data_parallel_size} processes" in message
