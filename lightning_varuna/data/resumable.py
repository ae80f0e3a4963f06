"""A training DataLoader that resumes mid-epoch at the sample where a checkpoint left it, at any world size.

Lightning's DistributedSampler deals the epoch's permutation out round-robin: replica ``d`` of ``D`` reads
positions ``d, d + D, ...``, so global batch ``j`` (each replica's ``j``-th batch together) is positions
``[j * G, (j + 1) * G)`` of the permutation, ``G`` being the global batch. The *position* of a run is therefore
one number per epoch, the rows consumed so far, and it means the same at any number of replicas: a run that
stopped after ``k`` global batches continues at position ``k * G`` with whatever ``D`` it restarts with, and
no sample of the epoch is skipped or read twice. (Lightning alone restarts a plain DataLoader from the start
of the epoch when resuming mid-epoch.)
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_varuna._lightning_private import dataloader_init_args, reinstantiate_dataloader

__all__ = [
    "DataPosition",
    "DataProgress",
    "ResumableDistributedSampler",
    "continue_unfinished_epoch",
    "epoch_rows",
    "resumable_loader",
]


@dataclass(frozen=True)
class DataPosition:
    """Rows of epoch ``epoch`` that training has consumed, over all replicas, and the order the epoch is read in
    (``shuffle`` and ``seed`` as `DistributedSampler` takes them; None where a checkpoint did not say)."""

    epoch: int
    rows: int
    shuffle: bool | None = None
    seed: int | None = None

    def advanced(self, rows: int) -> DataPosition:
        """The position ``rows`` further into the same epoch."""
        return replace(self, rows=self.rows + rows)

    def normalized(self, epoch_rows: int | None) -> DataPosition:
        """The start of the next epoch once all ``epoch_rows`` of this one are trained (unknown: as it is); the run
        that resumes there reads it in its own order."""
        if epoch_rows is not None and self.rows >= epoch_rows:
            return DataPosition(self.epoch + 1, 0)
        return self


def continue_unfinished_epoch(loops: dict[str, Any], position: DataPosition) -> None:
    """Make Lightning's restored fit loop continue an epoch that ``max_steps`` cut short.

    Lightning counts the epoch in which ``fit`` stopped at ``max_steps`` as processed (a checkpoint saved at its
    ``on_train_epoch_end``, as ``ModelCheckpoint(save_last=True)`` does) or completed (one saved after ``fit``), so a
    resumed fit (with a larger ``max_steps`` or no limit) would start the next epoch and never train the rest of that
    one. ``position`` says how far the epoch really got: count it as neither, and the fit loop resumes it at the next
    batch, as an uninterrupted run would have continued. ``loops`` is the checkpoint's ``"loops"`` entry, changed in
    place.
    """
    fit_loop = loops.get("fit_loop", {})
    progress = fit_loop.get("epoch_progress")
    if progress is None or position.rows == 0 or progress["current"]["processed"] <= position.epoch:
        return
    if fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch", False):
        return  # the epoch read its last batch (`limit_train_batches`, an IterableDataset): it ended
    for counter in ("current", "total"):
        progress[counter]["processed"] = progress[counter]["completed"] = position.epoch


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` (same order for the same seed and epoch) that can start an epoch at a position.

    The rest of that epoch is read in the order it began in (the position's), which another strategy may have chosen
    (SpillingStrategy keeps a DataLoader's order, Lightning's distributed sampler shuffles); later epochs in this
    sampler's. Its length stays the whole epoch's, as Lightning counts the batches of a resumed epoch from where the
    checkpoint left off; a resumed epoch simply runs out of samples that many batches early.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_from: DataPosition | None = None

    def __iter__(self) -> Iterator[int]:
        shuffle, seed, skipped = self.shuffle, self.seed, 0
        resumed = self.resume_from
        if resumed is not None and resumed.epoch == self.epoch:
            skipped = resumed.rows
            shuffle = shuffle if resumed.shuffle is None else resumed.shuffle
            seed = seed if resumed.seed is None else resumed.seed
        # The epoch's whole order, as torch's own sampler makes it for one replica.
        whole: DistributedSampler = DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        whole.set_epoch(self.epoch)
        order = list(whole)[skipped:]
        if self.drop_last:
            order = order[: len(order) - len(order) % self.num_replicas]
        elif order and len(order) % self.num_replicas:
            padding = self.num_replicas - len(order) % self.num_replicas
            order += (order * math.ceil(padding / len(order)))[:padding]
        return iter(order[self.rank :: self.num_replicas])


def resumable_loader(
    dataloader: DataLoader, sampler: DistributedSampler, batch_size: int, resume_from: DataPosition | None
) -> DataLoader:
    """``dataloader`` re-made to read ``batch_size`` rows per batch from a resumable copy of ``sampler``."""
    resumable = ResumableDistributedSampler(
        sampler.dataset,
        num_replicas=sampler.num_replicas,
        rank=sampler.rank,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
        drop_last=sampler.drop_last,
    )
    resumable.resume_from = resume_from
    args, kwargs = dataloader_init_args(dataloader, resumable)
    kwargs.update(
        sampler=None,
        shuffle=False,
        batch_sampler=BatchSampler(resumable, batch_size, drop_last=dataloader.drop_last),
        batch_size=1,
        drop_last=False,
    )
    return reinstantiate_dataloader(dataloader, *args, **kwargs)


def epoch_rows(loader: DataLoader, replicas: int) -> int:
    """Rows one epoch of a `resumable_loader` trains over all ``replicas``."""
    batch_sampler = loader.batch_sampler
    assert isinstance(batch_sampler, BatchSampler)
    per_replica = len(batch_sampler.sampler)  # type: ignore[arg-type]  # a ResumableDistributedSampler
    if batch_sampler.drop_last:
        per_replica -= per_replica % batch_sampler.batch_size
    return per_replica * replicas


# On a mid-epoch resume Lightning warns that a loader it cannot tell is resumable restarts the epoch. A resumable
# loader does not, so the warning is silenced while a fit reads one (a sweep runs several fits at once), and warns
# again for a later fit that does not.
_RESTART_WARNING = "You're resuming from a checkpoint that ended before the epoch"
_fits_reading_resumable_loaders = 0
_restart_warning_lock = threading.Lock()


def _silence_restart_warning() -> None:
    global _fits_reading_resumable_loaders
    with _restart_warning_lock:
        _fits_reading_resumable_loaders += 1
        if _fits_reading_resumable_loaders == 1:
            warnings.filterwarnings("ignore", message=_RESTART_WARNING)


def _restore_restart_warning() -> None:
    global _fits_reading_resumable_loaders
    with _restart_warning_lock:
        _fits_reading_resumable_loaders -= 1
        if _fits_reading_resumable_loaders == 0:
            filters = cast(list, warnings.filters)  # the list `filterwarnings` inserts into (typed a Sequence)
            filters[:] = [f for f in filters if not _silences_restart_warning(f)]


def _silences_restart_warning(warning_filter: tuple) -> bool:
    action, message = warning_filter[:2]
    return action == "ignore" and message is not None and message.pattern == _RESTART_WARNING


class DataProgress:
    """How far a run got into its training data, for its checkpoints; where a resumed run continues from.

    The position is kept as the rows of the epoch they belong to: a checkpoint taken after the epoch ended (Lightning
    has counted it done) must still say which epoch those rows were of, or a resumed run would skip the next one.
    """

    def __init__(self) -> None:
        self.position = DataPosition(0, 0)
        self.resume_from: DataPosition | None = None
        self.epoch_rows: int | None = None  # rows of an epoch over all replicas, once the loader is resumable
        self._order: dict[str, Any] = {}  # this run's `shuffle` and `seed`, once the loader is resumable
        self._in_flight: tuple[int, int] | None = None  # the last batch counted: (its number, its rows)
        self._sampler: ResumableDistributedSampler | None = None  # the resumable loader's, once made
        self._silencing = False  # whether this fit silences Lightning's restart warning

    def resumable(
        self, dataloader: DataLoader, sampler: DistributedSampler, batch_size: int, replicas: int
    ) -> DataLoader:
        """The training ``dataloader`` made resumable (`resumable_loader`), starting where a checkpoint left off."""
        if not self._silencing:
            _silence_restart_warning()
            self._silencing = True
        loader = resumable_loader(dataloader, sampler, batch_size, self.resume_from)
        self._sampler = loader.batch_sampler.sampler  # type: ignore[union-attr]
        self.epoch_rows = epoch_rows(loader, replicas)
        self._order = {"shuffle": sampler.shuffle, "seed": sampler.seed}
        return loader

    def fit_ended(self) -> None:
        """Lightning's warning that a loader restarts a resumed epoch applies again (to a later fit that reads no
        resumable loader)."""
        if self._silencing:
            _restore_restart_warning()
            self._silencing = False

    def warn_if_epoch_restarts(self, trainer: pl.Trainer) -> None:
        """At the start of ``trainer``'s training: warn where a loader of no length (an IterableDataset) begins an
        epoch that the checkpoint left unfinished from its first batch (Lightning warns so of the others only)."""
        progress: Any = trainer.fit_loop.epoch_loop.batch_progress  # (`current` is typed as its base class)
        trained = progress.current.processed
        if (
            trained
            and not progress.is_last_batch
            and self._sampler is None
            and trainer.num_training_batches == math.inf
        ):
            rank_zero_warn(
                f"The checkpoint was taken after {trained} batches of an epoch, and the training "
                "DataLoader, of no length (an IterableDataset), cannot continue there: the epoch starts again from "
                "its first batch, which trains those batches twice (as in Lightning). Checkpoint such runs at the "
                "ends of epochs, or have the dataset skip what the epoch read."
            )

    def epoch_started(self, epoch: int) -> None:
        self.position = DataPosition(epoch, 0, **self._order)

    def advance(self, rows: int, trainer: pl.Trainer) -> None:
        """``rows`` more rows (over all replicas): ``trainer``'s training batch, whose step begins."""
        self.position = self.position.advanced(rows)
        self._in_flight = (_batches(trainer).ready, rows)

    def saved(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The position for a checkpoint: the start of the next epoch once this one is trained. A batch that
        ``trainer`` has not counted processed is not trained: the checkpoint is taken as its step, backward or
        optimizer step fails (`OnExceptionCheckpoint`), and a run resumed from it reads that batch again, as an
        uninterrupted run trains it."""
        position = self.position
        if self._in_flight is not None and self._in_flight[0] > _batches(trainer).processed:
            position = position.advanced(-self._in_flight[1])
        return asdict(position.normalized(self.epoch_rows))

    def restore(self, saved: dict[str, Any] | None, loops: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``saved`` position (None: one without) and its Lightning ``loops`` state."""
        if saved is not None:
            self.resume_from = self.position = DataPosition(**saved)
            continue_unfinished_epoch(loops, self.resume_from)
            if self._sampler is not None:  # the loader was made first (`trainer.estimated_stepping_batches`)
                self._sampler.resume_from = self.resume_from


def _batches(trainer: pl.Trainer) -> Any:
    """Lightning's count of the fit's training batches (``ready``, ``processed``...) over its epochs and resumes."""
    return trainer.fit_loop.epoch_loop.batch_progress.total
