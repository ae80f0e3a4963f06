"""SpillingStrategy reads the data as one device does, and a run resumed mid-epoch goes on where it stopped:
set-up's look at the first batch makes the training loader once, leaves the loader's and Python's and NumPy's
generators as it found them and takes a batch of each DataLoader a step reads several of; a checkpoint taken
mid-epoch, at a limited epoch's end, by a schedule that reads the data first, under an accumulation schedule or as a
step fails resumes with the next batch an uninterrupted run trains."""

from __future__ import annotations

import copy
import random
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint, OnExceptionCheckpoint
from models import VOCAB, TinyLM, token_dataset
from spilled_runs import BUDGETS, assert_same_model, fit, losses
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_collate

from lightning_varuna import CutPoint, SpillingStrategy, VarunaStrategy


class BatchesRead(L.Callback):
    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        self.rows.append(batch[0][:, 0].tolist())


@pytest.mark.parametrize("budget", ["1GB", BUDGETS[5]], ids=["whole", "cut"])
def test_a_shuffled_loader_with_a_generator_of_its_own_is_read_in_its_order(budget):
    """Set-up looks at the first batch without drawing from the DataLoader's generator: training reads the batches
    in the order that generator gives, as on one device (before, the first epoch read the second's order)."""
    data = TensorDataset(torch.arange(48).view(12, 4) % VOCAB, torch.arange(48).view(12, 4) % VOCAB)
    rows = []
    for strategy in "auto", SpillingStrategy(memory_budget=budget):
        torch.manual_seed(0)
        read = BatchesRead()
        loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(123))
        fit(TinyLM(), strategy, loader=loader, callbacks=[read], max_steps=-1, max_epochs=2, val_check_interval=1.0)
        rows.append(read.rows)
    assert len(rows[0]) == 6
    assert rows[1] == rows[0]


class Augmented(torch.utils.data.Dataset):
    """Token rows with one position replaced at random, drawn from Python's and NumPy's global generators (as
    augmentations commonly are)."""

    def __init__(self) -> None:
        self.rows = torch.arange(48).view(12, 4) % VOCAB

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[i].clone()
        row[random.randrange(4)] = int(np.random.randint(VOCAB))
        return row, row


class TwoLoadersLM(TinyLM):
    """A step over a batch of each of two DataLoaders, which Lightning's loop combines in a dict."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        (a, a_labels), (b, b_labels) = batch["a"], batch["b"]
        return super().training_step((torch.cat([a, b]), torch.cat([a_labels, b_labels])), batch_idx)


def two_loaders() -> dict[str, DataLoader]:
    """Batches of 8 and 4 rows, in the order of one replica of VarunaStrategy's (`DistributedSampler`)."""
    first, second = token_dataset(64), token_dataset(48, seed=5)
    return {
        "a": DataLoader(first, batch_size=8, sampler=DistributedSampler(first, 1, 0, seed=0)),
        "b": DataLoader(second, batch_size=4, sampler=DistributedSampler(second, 1, 0, seed=0)),
    }


@pytest.mark.parametrize(
    "strategy", [lambda: SpillingStrategy(memory_budget=BUDGETS[5]), VarunaStrategy], ids=["spilled", "varuna"]
)
def test_a_step_over_several_dataloaders_trains_as_on_one_device(strategy):
    """Set-up looks at a batch of each DataLoader, combined as the loop combines them (it took the first one's
    alone, which the step could not read); spilled in 5 shards, and in one micro-batch under VarunaStrategy."""
    torch.manual_seed(0)
    reference = TwoLoadersLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto", loader=two_loaders(), max_steps=-1, max_epochs=2)
    trainer = fit(model, strategy(), loader=two_loaders(), max_steps=-1, max_epochs=2)
    assert len(losses(expected)) == 24  # 12 batches of the second loader an epoch, the first cycled
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_step_over_several_dataloaders_is_not_split_into_micro_batches():
    """VarunaStrategy splits a batch by the rows of its first tensor: every micro-batch would have got the whole
    batch of the second DataLoader, and trained on it twice."""
    with pytest.raises(ValueError, match=r"trains on 2 DataLoaders combined .*`micro_batch_size=4`.*one micro-batch"):
        fit(TwoLoadersLM(), VarunaStrategy(micro_batch_size=4), loader=two_loaders())


class CountsLoaders(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.loaders_made = 0

    def train_dataloader(self) -> DataLoader:
        self.loaders_made += 1
        return DataLoader(token_dataset(16), batch_size=4)


@pytest.mark.parametrize(
    "strategy",
    [lambda: SpillingStrategy(memory_budget=BUDGETS[5]), VarunaStrategy, lambda: VarunaStrategy(micro_batch_size=2)],
    ids=["spilled", "varuna", "varuna-micro-batches-given"],
)
def test_set_up_makes_the_training_loader_once_to_look_at_its_first_batch(strategy):
    """`train_dataloader()` (which may start a loader's workers) is called once more than plain Lightning calls it:
    to look at the first batch. VarunaStrategy called it twice more where it chose the micro-batch size itself."""
    plain, ours = CountsLoaders(), CountsLoaders()
    options = {"accelerator": "cpu", "devices": 1, "max_epochs": 2, "logger": False, "enable_progress_bar": False}
    L.Trainer(**options).fit(plain)
    L.Trainer(strategy=strategy(), **options).fit(ours)
    assert plain.loaders_made == 1
    assert ours.loaders_made == plain.loaders_made + 1


class PredictsFromEach(TinyLM):
    def predict_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])


@pytest.mark.parametrize(
    "strategy",
    [lambda: SpillingStrategy(memory_budget=BUDGETS[5]), lambda: VarunaStrategy(micro_batch_size=2)],
    ids=["spilled", "varuna"],
)
def test_predicting_over_several_dataloaders_gives_one_device_s_predictions(strategy):
    """An evaluation loop reads its DataLoaders one after another: set-up looks at the first one's batch, and
    batches of each, of other shapes, are split as they come (the refusal of a combined training batch once
    refused them too)."""
    loaders = [DataLoader(token_dataset(12), batch_size=4), DataLoader(token_dataset(10, seed=3), batch_size=5)]
    torch.manual_seed(0)
    model = PredictsFromEach()
    options = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False}
    expected = L.Trainer(**options).predict(model, loaders)
    predicted = L.Trainer(strategy=strategy(), **options).predict(model, loaders)
    for ours, theirs in zip(predicted, expected):
        torch.testing.assert_close(torch.cat(ours), torch.cat(theirs))


class TableLM(TinyLM):
    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        idx, labels, table = batch
        return super().training_step((idx, labels + table.sum().long()), batch_idx)


def test_a_tensor_of_the_batch_given_whole_to_every_micro_batch_is_named():
    """A tensor whose dim 0 is not the batch's goes whole to every micro-batch: right for a table, wrong for rows
    of the batch collated another way (all of a batch's boxes in one tensor), so set-up names it."""
    data = token_dataset(64)
    loader = DataLoader(data, batch_size=8, collate_fn=lambda rows: (*default_collate(rows), torch.zeros(3, 2)))
    with pytest.warns(UserWarning, match=r"gives `batch\[2\]` whole to every micro-batch: .* \(8, the rows"):
        fit(TableLM(), VarunaStrategy(micro_batch_size=4), loader=loader, max_steps=1)


class ListOfSamples(L.LightningModule):
    """Takes its inputs as a tuple of samples, one tensor each, stacked inside (as torchvision's detection models take
    their images, or a model that pads its sequences itself, sequence first)."""

    def __init__(self, images: bool) -> None:
        super().__init__()
        self.images = images
        self.embed = nn.Conv2d(3, 4, 3, padding=1) if images else nn.Embedding(VOCAB, 4)
        self.cut, self.head = CutPoint(), nn.Linear(4, 2)

    def forward(self, samples: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.images:
            return self.head(self.cut(self.embed(torch.stack(samples)).relu().mean((2, 3))))
        tokens = self.cut(self.embed(torch.stack(samples, dim=1)))  # sequence first, as nn.Transformer's default
        return self.head(tokens.mean(0))

    def training_step(self, batch: tuple[tuple[torch.Tensor, ...], ...], batch_idx: int) -> torch.Tensor:
        samples, labels = batch
        return F.cross_entropy(self(samples), torch.stack(labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("images", [True, False], ids=["images", "token-sequences"])
def test_a_batch_that_lists_its_samples_is_refused(images):
    """4 samples collated as a tuple of tensors (images of [3, 8, 8], or sequences of 8 tokens): the batch's first
    tensor's dim 0 is a channel or a token, not a sample. Split along it, each sequence trained in pieces of 2 tokens,
    silently (the images stopped at their CutPoint's check of the batch size); set-up refuses such a batch, naming
    it."""
    generator = torch.Generator().manual_seed(0)
    make = (lambda: torch.randn(3, 8, 8, generator=generator)) if images else lambda: torch.randint(0, VOCAB, (8,))
    loader = DataLoader(
        [(make(), torch.tensor(i % 2)) for i in range(16)], batch_size=4, collate_fn=lambda s: tuple(zip(*s))
    )
    rows = 3 if images else 8
    with pytest.raises(ValueError, match=rf"`batch\[0\]` holds the batch's 4 samples as a list.*dim 0 \({rows} here\)"):
        fit(ListOfSamples(images), VarunaStrategy(micro_batch_size=2), loader=loader)


class SequenceFirst(TinyLM):
    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        idx, labels = batch
        return super().training_step((idx.T, labels.T), batch_idx)


def test_a_sequence_first_batch_split_into_micro_batches_is_warned_of():
    """A batch collated as (tokens, batch) has the DataLoader's 8 samples in dim 1: split along dim 0, each sequence
    would train in pieces. Its rows are not the samples the DataLoader collated, and set-up warns saying so."""
    loader = DataLoader(token_dataset(64), batch_size=8, collate_fn=lambda rows: [t.T for t in default_collate(rows)])
    with pytest.warns(UserWarning, match=r"along its first tensor's dim 0 \(6 rows\), but the DataLoader collated 8"):
        fit(SequenceFirst(), VarunaStrategy(micro_batch_size=4), loader=loader, max_steps=1)


def test_a_batch_of_two_rows_a_sample_is_split_with_a_warning_and_trains_as_one_micro_batch():
    """A collate that makes two rows of each of 2 samples: a batch (ids, labels) of 4 rows, as many fields as
    samples. Its rows are split into micro-batches (warned of: they are not the samples), not refused as a list of
    samples, and train as the whole batch in one micro-batch."""
    loader = DataLoader(
        token_dataset(16), batch_size=2, collate_fn=lambda s: [t.repeat(2, 1) for t in default_collate(s)]
    )
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, VarunaStrategy(micro_batch_size=4), loader=loader)
    with pytest.warns(UserWarning, match=r"dim 0 \(4 rows\), but the DataLoader collated 2 samples"):
        trainer = fit(model, VarunaStrategy(micro_batch_size=2), loader=loader)
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


@pytest.mark.parametrize("budget", ["1GB", BUDGETS[5]], ids=["whole", "cut"])
def test_a_dataset_augmented_with_python_and_numpy_random_numbers_reads_as_on_one_device(budget):
    """Set-up's look at the first batch gives Python's and NumPy's generators back their states: the loop's batches
    are augmented as on one device (before, each was augmented as the one after it)."""
    rows = []
    for strategy in "auto", SpillingStrategy(memory_budget=budget):
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        read = BatchesRead()
        fit(
            TinyLM(),
            strategy,
            loader=DataLoader(Augmented(), batch_size=4),
            callbacks=[read],
            accumulate_grad_batches=1,
            limit_val_batches=0,
        )
        rows.append(read.rows)
    assert len(rows[0]) == 4
    assert rows[1] == rows[0]


def test_a_checkpoint_of_an_epoch_read_in_order_resumes_pipelined_in_that_order(tmp_path):
    """SpillingStrategy keeps a DataLoader's order (here unshuffled); VarunaStrategy reads through Lightning's
    distributed sampler, which shuffles. A spilled checkpoint taken mid-epoch resumes pipelined with the rest of that
    epoch in its order: the batches and losses of the uninterrupted spilled run (before, the rest of the epoch was
    read shuffled: some rows trained twice, others never)."""

    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    options: dict[str, Any] = {"accumulate_grad_batches": 1, "limit_val_batches": 0, "val_check_interval": 1.0}

    def loader() -> DataLoader:
        return DataLoader(token_dataset(24), batch_size=4)  # 6 batches, read in order

    read = BatchesRead()
    expected = fit(reference, SpillingStrategy(memory_budget=BUDGETS[5]), loader=loader(), callbacks=[read], **options)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), loader=loader(), callbacks=[saves], max_steps=2, **options)
    resumed_read = BatchesRead()
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    continued = fit(model, VarunaStrategy(), loader=loader(), callbacks=[resumed_read], ckpt_path=path, **options)
    assert resumed_read.rows == read.rows[2:]
    torch.testing.assert_close(losses(continued), losses(expected)[2:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class ScheduledByEstimatedSteps(TinyLM):
    """Its LR schedule's length is ``trainer.estimated_stepping_batches``, as Hugging Face's linear warm-up recipes
    take it: `configure_optimizers` reads the training DataLoader before the checkpoint is restored."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize("strategy", ["varuna", "spilled"])
def test_a_mid_epoch_checkpoint_resumes_where_it_was_taken_when_the_optimizer_reads_the_data_first(tmp_path, strategy):
    """`configure_optimizers` reading `trainer.estimated_stepping_batches` made the DataLoader before the checkpoint
    was restored: the resumed run read its epoch from the start again (training its first batches twice)."""
    torch.manual_seed(0)
    reference = ScheduledByEstimatedSteps()
    model = copy.deepcopy(reference)
    options: dict[str, Any] = {"accumulate_grad_batches": 1, "limit_val_batches": 0, "max_steps": -1, "max_epochs": 1}

    def make() -> Any:
        return VarunaStrategy() if strategy == "varuna" else SpillingStrategy(memory_budget=BUDGETS[5])

    read, resumed_read = BatchesRead(), BatchesRead()
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    expected = fit(reference, make(), callbacks=[read, saves], **options)
    continued = fit(model, make(), str(tmp_path / "epoch=0-step=3.ckpt"), callbacks=[resumed_read], **options)
    assert resumed_read.rows == read.rows[3:]
    torch.testing.assert_close(losses(continued), losses(expected)[3:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


@pytest.mark.parametrize("strategy", ["varuna", "spilled"])
def test_a_mid_epoch_checkpoint_resumes_accumulating_as_the_epochs_schedule_says(tmp_path, strategy):
    """`GradientAccumulationScheduler({0: 1, 1: 2})`, resumed in the middle of epoch 1: Lightning runs no epoch-start
    hook there, so the resumed run stepped after every batch (plain Lightning does too) where an uninterrupted run
    accumulates 2."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    options: dict[str, Any] = {"limit_val_batches": 0, "max_steps": -1, "max_epochs": 2}
    options.update(gradient_clip_val=None, accumulate_grad_batches=1)

    def make() -> Any:
        return VarunaStrategy() if strategy == "varuna" else SpillingStrategy(memory_budget=BUDGETS[5])

    def schedule() -> GradientAccumulationScheduler:
        return GradientAccumulationScheduler({0: 1, 1: 2})

    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    expected = fit(reference, make(), callbacks=[schedule(), saves], **options)
    path = str(tmp_path / "epoch=1-step=10.ckpt")  # after batch 4 of epoch 1's 8
    continued = fit(model, make(), path, callbacks=[schedule()], **options)
    assert continued.global_step == expected.global_step == 12
    torch.testing.assert_close(losses(continued), losses(expected)[12:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_checkpoint_at_the_end_of_a_limited_epoch_resumes_with_the_next_epoch(tmp_path):
    """`limit_train_batches` ends the epoch before its rows run out: a checkpoint saved at its end (ModelCheckpoint's
    `save_last`) resumes with the next epoch, as one uninterrupted run goes on (not with the epoch's unread rows)."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    options: dict[str, Any] = {"accumulate_grad_batches": 1, "limit_val_batches": 0, "limit_train_batches": 2}
    options.update(max_steps=-1, val_check_interval=1.0)

    def loader() -> DataLoader:
        return DataLoader(token_dataset(24), batch_size=4)

    read, resumed_read = BatchesRead(), BatchesRead()
    expected = fit(
        reference,
        SpillingStrategy(memory_budget=BUDGETS[5]),
        loader=loader(),
        callbacks=[read],
        max_epochs=2,
        **options,
    )
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), loader=loader(), callbacks=[saves], max_epochs=1, **options)
    path = str(tmp_path / "last.ckpt")
    continued = fit(
        model,
        SpillingStrategy(memory_budget=BUDGETS[5]),
        path,
        loader(),
        callbacks=[resumed_read],
        max_epochs=2,
        **options,
    )
    assert resumed_read.rows == read.rows[2:]
    torch.testing.assert_close(losses(continued), losses(expected)[2:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class FailsOnce(TinyLM):
    """Raises at the batch ``fail_at`` (as a bad batch would in the step, or running out of memory in the backward),
    once."""

    fail_at: int | None = 3
    fail_in = "training_step"

    def _fail_here(self, where: str) -> None:
        if where == self.fail_in and self.global_step == self.fail_at:
            self.fail_at = None
            raise RuntimeError(f"failed in {where}")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._fail_here("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._fail_here("on_before_backward")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:  # as the step running out of memory
        self._fail_here("on_before_optimizer_step")


@pytest.mark.parametrize(
    ("fail_in", "clip"),
    [("training_step", None), ("on_before_backward", None), ("on_before_optimizer_step", 0.5)],
)
def test_the_checkpoint_taken_as_a_step_fails_resumes_with_that_batch(tmp_path, fail_in, clip):
    """`OnExceptionCheckpoint` saves as the step, its backward or its optimizer step (after the backward when the
    gradients are clipped) fails: the failed batch was not trained, and the resumed run trains it, as an
    uninterrupted run does (before, it was counted as trained and skipped)."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = FailsOnce()
    model.fail_in = fail_in
    model.load_state_dict(reference.state_dict())
    options = {"gradient_clip_val": clip, "accumulate_grad_batches": 1, "max_steps": 6}
    expected = fit(reference, "auto", **options)
    saves = OnExceptionCheckpoint(dirpath=tmp_path)
    with pytest.raises(RuntimeError, match=f"failed in {fail_in}"):
        fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), callbacks=[saves], **options)
    path = str(tmp_path / "on_exception.ckpt")
    continued = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), ckpt_path=path, **options)
    torch.testing.assert_close(losses(continued), losses(expected)[3:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_lightning_warns_of_a_restarted_epoch_only_where_the_loader_restarts_it(tmp_path, recwarn):
    """A spilled fit resumed mid-epoch reads the rest of the epoch, so Lightning's warning that the epoch restarts is
    silenced while it runs; a plain fit resumed after it (whose loader does restart the epoch) warns again."""

    def restarts() -> int:
        caught = [w for w in recwarn.list if "resuming from a checkpoint that ended before the epoch" in str(w.message)]
        recwarn.clear()
        return len(caught)

    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    fit(TinyLM(), "auto", callbacks=[saves], max_steps=1, accumulate_grad_batches=1)
    mid_epoch = str(tmp_path / "epoch=0-step=1.ckpt")  # after batch 1 of 8
    restarts()
    fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[5]), mid_epoch, max_steps=2, accumulate_grad_batches=1)
    spilled = restarts()
    fit(TinyLM(), "auto", mid_epoch, max_steps=2, accumulate_grad_batches=1)
    assert [spilled, restarts()] == [0, 1]


class SaveAfterBatch(L.Callback):
    """Saves at ``path`` after the first epoch's batch ``batch_idx``, as a user's hook may."""

    def __init__(self, path: str, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.current_epoch == 0 and args[-1] == self.batch_idx:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("strategy", ["varuna", "spilled"])
def test_a_checkpoint_taken_inside_an_accumulated_step_warns_as_it_resumes(tmp_path, strategy, recwarn):
    """Steps of 3 batches, 8 batches an epoch: a checkpoint after batch 4 holds 2 batches' gradients that are lost,
    and resuming from it says so; one after batch 5 (a step) or at the epoch's end (its last step, of 2) does not."""

    def make() -> Any:
        return VarunaStrategy() if strategy == "varuna" else SpillingStrategy(memory_budget=BUDGETS[5])

    def resumed_warnings(path: str) -> list[str]:
        recwarn.clear()
        fit(TinyLM(), make(), path, **options)
        return [str(w.message) for w in recwarn.list if "holds no gradients" in str(w.message)]

    options: dict[str, Any] = {"max_steps": -1, "max_epochs": 2, "accumulate_grad_batches": 3, "limit_val_batches": 0}
    inside, at_step, at_end = (str(tmp_path / name) for name in ("inside.ckpt", "at_step.ckpt", "at_end.ckpt"))
    saves = [SaveAfterBatch(inside, 4), SaveAfterBatch(at_step, 5)]
    fit(TinyLM(), make(), callbacks=saves, **{**options, "max_epochs": 1}).save_checkpoint(at_end)
    (warned,) = resumed_warnings(inside)
    assert "2 batch(es) into a step that accumulates 3" in warned and "other 1 batch(es)" in warned
    assert resumed_warnings(at_step) == resumed_warnings(at_end) == []
