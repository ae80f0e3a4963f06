"""`lightning_varuna.comparing`: one device trains on the global batches of a data-parallel run, and docs/comparing.md's
script finds a pipelined run and one device alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_job, run_ranks
from torch.utils.data import DistributedSampler

from lightning_varuna.comparing import GlobalBatches

DOCS = Path(__file__).resolve().parents[1] / "docs" / "comparing.md"


def replica_batches(length: int, batch_size: int, replicas: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """What each replica reads in ``epoch``, batch by batch: its part of Lightning's shuffling `DistributedSampler`."""
    batches = []
    for rank in range(replicas):
        sampler = DistributedSampler(range(length), replicas, rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches.append([order[i : i + batch_size] for i in range(0, len(order), batch_size)])
    return batches


@pytest.mark.parametrize(("length", "drop_last"), [(40, False), (46, False), (46, True)])
def test_global_batches_put_the_replicas_batches_together_epoch_after_epoch(length, drop_last):
    """Step ``j`` reads every replica's ``j``-th batch, replica 0's first; each iteration is the next epoch, and the
    first can be a later one (a resumed run's); a short last batch is dropped with ``drop_last``."""
    sampler = GlobalBatches(length, batch_size=4, data_parallel_size=3, seed=7, first_epoch=2, drop_last=drop_last)
    for epoch in (2, 3):
        per_replica = replica_batches(length, 4, 3, seed=7, epoch=epoch)
        expected = [sum(batches, []) for batches in zip(*per_replica)]
        if drop_last:
            expected = [batch for batch in expected if len(batch) == 4 * 3]
        assert list(sampler) == expected
        assert len(sampler) == len(expected)
    assert {i for batch in expected for i in batch} <= set(range(length))


@pytest.mark.parametrize("arguments", [(0, 4, 2), (8, 0, 2), (8, 4, 0)])
def test_global_batches_refuse_sizes_below_one(arguments):
    length, batch_size, replicas = arguments
    with pytest.raises(ValueError, match=r"`GlobalBatches\(.*must all be at least 1"):
        GlobalBatches(length, batch_size=batch_size, data_parallel_size=replicas)


@pytest.mark.slow
def test_the_docs_script_finds_a_pipelined_run_and_one_device_alike(tmp_path):
    """docs/comparing.md's `compare.py` as written: 2 stages x 2 replicas in 4 processes, then one device on
    `GlobalBatches`, with the same losses and weights."""
    (script,) = re.findall(r"```python\n(# compare\.py.*?)```", DOCS.read_text(), flags=re.DOTALL)
    (tmp_path / "compare.py").write_text(script)
    pipelined = run_ranks(["compare.py", "pipelined"], 4, tmp_path)
    assert pipelined.returncode == 0, pipelined.stdout[-3000:] + pipelined.stderr[-6000:]
    one_device = run_job(["compare.py", "one-device"], tmp_path)
    assert one_device.returncode == 0, one_device.stdout[-3000:] + one_device.stderr[-6000:]
    assert "6 steps: the same losses and weights" in one_device.stdout
