"""The resumable sampler deals exactly what torch's DistributedSampler deals, and resumes at any replica count."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from lightning_varuna.data.resumable import DataPosition, ResumableDistributedSampler


@pytest.mark.parametrize(
    ("rows", "replicas", "shuffle", "drop_last"),
    [(24, 2, True, False), (23, 4, True, False), (23, 4, False, True), (5, 3, True, False)],
)
def test_same_order_as_torch(rows, replicas, shuffle, drop_last):
    options = {"shuffle": shuffle, "seed": 7, "drop_last": drop_last}
    for epoch in range(3):
        for rank in range(replicas):
            ours = ResumableDistributedSampler(range(rows), replicas, rank, **options)
            torchs = DistributedSampler(range(rows), replicas, rank, **options)
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) and len(ours) == len(torchs)


def test_resumes_the_epoch_where_two_replicas_stopped_with_one():
    """Two replicas trained 2 global batches of 6; one replica reads the rest of that epoch, then whole epochs."""
    before = [ResumableDistributedSampler(range(24), 2, rank, seed=0) for rank in range(2)]
    for sampler in before:
        sampler.set_epoch(1)
    trained = {i for sampler in before for i in list(sampler)[:6]}
    after = ResumableDistributedSampler(range(24), 1, 0, seed=0)
    after.resume_from = DataPosition(epoch=1, rows=12)
    after.set_epoch(1)
    rest = list(after)
    assert len(rest) == 12 and trained.isdisjoint(rest) and trained | set(rest) == set(range(24))
    after.set_epoch(2)
    assert len(list(after)) == 24
