"""The training DataLoader of each data-parallel replica (VarunaStrategy's): resumable mid-epoch and, given a global
batch, re-batched to the replica's share of it, so that a job that restarts at another world size trains the same
model."""

from __future__ import annotations

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_varuna.data.resumable import DataProgress

__all__ = ["resumable_for_replicas"]


def resumable_for_replicas(
    dataloader: object, progress: DataProgress, replicas: int, global_batch_size: int | None = None
) -> object:
    """``dataloader`` made resumable where ``progress`` says (`DataProgress.resumable`) and, with
    ``global_batch_size``, re-batched to ``global_batch_size / replicas`` rows. A loader that Lightning's distributed
    sampler does not read alone in plain batches (a custom ``sampler`` or ``batch_sampler``, an IterableDataset) is
    kept as it is.

    Raises:
        ValueError: ``global_batch_size`` is given for a loader that is kept as it is.
    """
    sampler = getattr(dataloader, "sampler", None)
    # Lightning's sampler over the dataset; not its wrapper of a custom sampler (a subclass), whose order it keeps.
    resumable = isinstance(dataloader, DataLoader) and type(sampler) is DistributedSampler
    if not resumable or type(getattr(dataloader, "batch_sampler", None)) is not BatchSampler:
        if global_batch_size is not None:
            raise ValueError(
                "`VarunaStrategy(global_batch_size=...)` re-batches the training DataLoader, which needs a "
                "map-style dataset, Lightning's distributed sampler (`Trainer(use_distributed_sampler=True)`), "
                "no custom `sampler` and no `batch_sampler`. Remove `global_batch_size` and size the DataLoader "
                "batch yourself: global batch = DataLoader batch x data_parallel_size."
            )
        return dataloader
    assert isinstance(dataloader, DataLoader) and isinstance(sampler, DistributedSampler)
    batch_size = dataloader.batch_size
    assert batch_size is not None  # a plain BatchSampler
    if global_batch_size is not None:
        batch_size = global_batch_size // replicas
    return progress.resumable(dataloader, sampler, batch_size, replicas)
