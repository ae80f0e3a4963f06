"""A single device's training DataLoader that resumes mid-epoch, as VarunaStrategy's do: read in the order of
Lightning's `DistributedSampler` for one replica, its position kept by `DataProgress`."""

from __future__ import annotations

import os

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from lightning_varuna.data.resumable import DataProgress

__all__ = ["lightning_seed", "resumable_on_one_device"]


def resumable_on_one_device(
    dataloader: DataLoader,
    progress: DataProgress,
    *,
    shuffle: bool | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
) -> DataLoader:
    """``dataloader`` made resumable by ``progress`` if it reads a map-style dataset in order or shuffled by torch's
    default samplers (shuffled: a permutation seeded by ``seed_everything`` and the epoch, as Lightning's sampler
    for several replicas); as it is if its order is the user's own making (a sampler of theirs, a `RandomSampler`
    with replacement, its own generator or another number of samples, a ``batch_sampler``).

    ``shuffle`` (None: as the loader does) and ``batch_size`` (None: the loader's) read it as a pipelined run of one
    replica does: Lightning shuffles every distributed run's training data, and ``global_batch_size`` re-batches it.
    ``seed`` (None: ``seed_everything``'s now, as Lightning's sampler reads it) seeds the shuffled order.

    Raises:
        ValueError: ``batch_size`` is given for a loader that is kept as it is.
    """
    sampler = dataloader.sampler
    if (
        type(sampler) not in (SequentialSampler, RandomSampler)
        or dataloader.batch_size is None
        or (
            isinstance(sampler, RandomSampler)
            and (
                sampler.replacement or sampler.num_samples != len(sampler.data_source) or sampler.generator is not None
            )
        )
    ):
        if batch_size is not None:
            raise ValueError(
                "`VarunaStrategy(global_batch_size=...)` re-batches the training DataLoader, which needs a map-style "
                "dataset read in order or shuffled, no custom `sampler` and no `batch_sampler`."
            )
        return dataloader
    if shuffle is None:
        shuffle = isinstance(sampler, RandomSampler)
    batch_size = batch_size or dataloader.batch_size
    seed = lightning_seed() if seed is None else seed
    one_replica: DistributedSampler = DistributedSampler(
        dataloader.dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed
    )
    return progress.resumable(dataloader, one_replica, batch_size, replicas=1)


def lightning_seed() -> int:
    """The seed `L.seed_everything` set last (``PL_GLOBAL_SEED``), which Lightning's sampler shuffles by; else 0."""
    return int(os.getenv("PL_GLOBAL_SEED", 0))
