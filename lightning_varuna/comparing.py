"""What a single-device run needs to train on what a data-parallel run trains on, so that the two can be compared
step by step (see docs/comparing.md).

Under any distributed strategy Lightning replaces a training DataLoader's sampler with a `DistributedSampler` that
shuffles (seed ``PL_GLOBAL_SEED``, which `L.seed_everything` sets, else 0; reshuffled each epoch), even for a
DataLoader built with ``shuffle=False``, and each replica reads its own part of the epoch. `GlobalBatches` gives one
device the union of the replicas' batches, step by step; `LoggedLosses` records what each step logged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DistributedSampler, Sampler

__all__ = ["GlobalBatches", "LoggedLosses"]


class GlobalBatches(Sampler[list[int]]):
    """A batch sampler whose ``j``-th batch of an epoch is the ``j``-th batches of ``data_parallel_size`` replicas
    put together, in replica order: what `VarunaStrategy` (or DDP) trains on at step ``j`` with a DataLoader of
    ``batch_size`` rows per replica. Pass it as a DataLoader's ``batch_sampler``::

        loader = DataLoader(dataset, batch_sampler=GlobalBatches(len(dataset), batch_size=8, data_parallel_size=2))

    Each epoch reshuffles, as Lightning's sampler does with the epoch number; iterating the sampler again starts the
    next epoch.

    Args:
        length: the dataset's length.
        batch_size: one replica's batch: the DataLoader's ``batch_size`` in the data-parallel run (with
            ``VarunaStrategy(global_batch_size=G)``: ``G // data_parallel_size``).
        data_parallel_size: the replicas of the data-parallel run (`VarunaStrategy`'s ``data_parallel_size``).
        seed: the seed of Lightning's sampler: the one given to `L.seed_everything` in the data-parallel run (0 if
            none was).
        first_epoch: the epoch the first iteration reads: that of a checkpoint taken at the end of epoch
            ``first_epoch - 1`` when the single-device run resumes from it.
        drop_last: as the DataLoader's ``drop_last``: leave out each epoch's last batch when the replicas' last
            batches are short.
    """

    def __init__(
        self,
        length: int,
        *,
        batch_size: int,
        data_parallel_size: int,
        seed: int = 0,
        first_epoch: int = 0,
        drop_last: bool = False,
    ) -> None:
        if length < 1 or batch_size < 1 or data_parallel_size < 1:
            raise ValueError(
                f"`GlobalBatches({length}, batch_size={batch_size}, data_parallel_size={data_parallel_size})`: "
                "the length, the batch size and the replicas must all be at least 1."
            )
        positions: Any = range(length)  # what DistributedSampler reads of a dataset: its length
        self.samplers: list[DistributedSampler] = [
            DistributedSampler(positions, data_parallel_size, rank, shuffle=True, seed=seed)
            for rank in range(data_parallel_size)
        ]
        self.batch_size, self.drop_last = batch_size, drop_last
        self.epoch = first_epoch

    def __iter__(self) -> Iterator[list[int]]:
        orders = []
        for sampler in self.samplers:
            sampler.set_epoch(self.epoch)
            orders.append(list(sampler))
        self.epoch += 1
        for start in range(0, len(orders[0]), self.batch_size):
            if self.drop_last and start + self.batch_size > len(orders[0]):
                return
            yield [i for order in orders for i in order[start : start + self.batch_size]]

    def __len__(self) -> int:
        per_replica = len(self.samplers[0])
        return per_replica // self.batch_size if self.drop_last else -(-per_replica // self.batch_size)


class LoggedLosses(L.Callback):
    """The value logged as ``name`` after each training batch, in ``losses`` (a list of floats): on every rank, and
    on rank 0 of a pipelined run (which holds the last stage) the value `self.log` reports.

    Args:
        name: the logged key, as given to `self.log`.
    """

    def __init__(self, name: str = "train_loss") -> None:
        self.name = name
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        value = trainer.callback_metrics.get(self.name)
        if value is not None:
            self.losses.append(float(value))
