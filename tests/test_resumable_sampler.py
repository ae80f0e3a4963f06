"""The resumable sampler deals exactly what torch's DistributedSampler deals, and resumes at any replica count; a
DataLoader's own sampler is left as it is, and a loader that cannot resume mid-epoch says so."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_varuna import CutPoint, SpillingStrategy, VarunaStrategy
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


class Rows(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(index)]), torch.tensor([float(index)])


class RowsSeen(L.Callback):
    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.rows += [int(row) for row in batch[0].flatten()]


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.cut, self.last = nn.Linear(1, 8), CutPoint(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.cut(self.first(x))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("strategy", ["auto", VarunaStrategy, SpillingStrategy])
def test_a_custom_sampler_reads_its_own_rows(strategy):
    """A DataLoader's own sampler (a fixed split) is read as it is: Lightning wraps it for its distributed sampler,
    and that wrapper is not the dataset's sampler to be made resumable (it was: the wrapper's positions were read as
    rows of the dataset, rows 0-7 for 8-15)."""
    seen = RowsSeen()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy if isinstance(strategy, str) else strategy(),
        max_epochs=1,
        callbacks=[seen],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(Rows(), batch_size=4, sampler=list(range(8, 16))))
    assert sorted(seen.rows) == list(range(8, 16))


class RowStream(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(Rows()[i] for i in range(len(Rows())))


@pytest.mark.parametrize("strategy", [VarunaStrategy, SpillingStrategy])
def test_an_iterable_dataset_resumed_mid_epoch_warns_that_the_epoch_restarts(tmp_path, strategy):
    """A loader of no length cannot continue an epoch where a checkpoint left it: the resumed fit says that the epoch
    starts again (Lightning says so of loaders with a length only); resumed at an epoch's end, it says nothing."""

    def fit(max_steps: int, ckpt_path: str | None = None) -> None:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy(),
            max_steps=max_steps,
            callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Regression(), DataLoader(RowStream(), batch_size=4), ckpt_path=ckpt_path)

    fit(max_steps=6)  # epochs of 4 batches: saves at steps 2 (mid-epoch), 4 (its end) and 6
    with pytest.warns(UserWarning, match="after 2 batches of an epoch.*the epoch starts again from its first batch"):
        fit(max_steps=8, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "The checkpoint was taken after")
        fit(max_steps=8, ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
