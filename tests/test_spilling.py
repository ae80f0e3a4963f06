"""SpillingStrategy trains exactly like plain single-device training, within its memory budget."""

from __future__ import annotations

import contextlib
import copy
import os
import random
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    ModelCheckpoint,
    OnExceptionCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from models import DIM, VOCAB, Block, CountingLM, TinyLM, token_dataset
from spilled_runs import (
    BUDGETS,
    StepLosses,
    assert_same_model,
    fit,
    losses,
)
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_varuna
from lightning_varuna import CutPoint, SpillingStrategy, VarunaStrategy, cut_after
from lightning_varuna.checkpoint.consolidate import consolidate
from lightning_varuna.checkpoint.layout import find_newest, open_complete
from lightning_varuna.demos import MLP
from lightning_varuna.spilling.packing import parse_bytes
from lightning_varuna.storage import Storage


class SGDTinyLM(TinyLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class GroupedTinyLM(TinyLM):
    """Two parameter groups, the first of them the parameters that come last in the model."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        matrices = [p for p in self.parameters() if p.ndim > 1]
        vectors = [p for p in self.parameters() if p.ndim <= 1]
        groups = [{"params": vectors[::-1], "weight_decay": 0.0}, {"params": matrices, "weight_decay": 0.5}]
        return torch.optim.AdamW(groups, lr=self.lr)


class EmptyGroupTinyLM(TinyLM):
    """A parameter group with no parameters (a model without biases, grouped for weight decay)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": list(self.parameters())}, {"params": [], "weight_decay": 0.0}], lr=self.lr)


@pytest.mark.parametrize("model_class", [TinyLM, SGDTinyLM], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("num_shards", [1, 2, 5])
@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
@pytest.mark.parametrize("clip", [0.5, None], ids=["clipped", "stepped-in-backward"])
def test_trains_like_one_device(tmp_path, model_class, num_shards, disk, clip):
    """Per-step losses, validation loss and final weights equal plain training: dropout on, an LR schedule,
    accumulated batches, a weight tied between the first and last shard; with clipping by the global norm (an
    optimizer pass after backward), and without (each shard steps right after its backward)."""
    torch.manual_seed(0)
    reference = model_class(dropout=0.1, scheduler=True)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit(reference, "auto", gradient_clip_val=clip)
    torch.manual_seed(1)
    strategy = SpillingStrategy(memory_budget=BUDGETS[num_shards], spill_dir=tmp_path if disk else None)
    trainer = fit(model, strategy, gradient_clip_val=clip)
    assert len(strategy.shards) == num_shards
    assert strategy.optimizer_in_backward == (clip is None)
    assert sum(len(shard) for shard in strategy.shards) == 5
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert losses(trainer) and len(set(losses(trainer))) > 1
    torch.testing.assert_close(trainer.callback_metrics["val_loss"], expected.callback_metrics["val_loss"])
    assert_same_model(model, reference)
    assert not list(tmp_path.glob("spill-*")), "the spilled files are removed after training"


class RowBiasLM(TinyLM):
    """A model with its batch size built in: a learned bias per row of a batch of 8."""

    def __init__(self) -> None:
        super().__init__()
        self.row_bias = nn.Parameter(torch.randn(8, 1, VOCAB))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.row_bias


def check_spilled_like_one_device(model_class: type[L.LightningModule], shards: int) -> None:
    """A ``model_class`` trained on one device and one spilled in ``shards`` shards, from the same start: the same
    losses and weights."""
    torch.manual_seed(0)
    reference = model_class()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto")
    strategy = SpillingStrategy(memory_budget=BUDGETS[shards])
    trainer = fit(model, strategy)
    assert len(strategy.shards) == shards
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_model_with_its_batch_size_built_in_trains_like_one_device():
    """Set-up finds the CutPoints on two rows of the first batch; a model that cannot run two rows is probed with
    the whole batch."""
    check_spilled_like_one_device(RowBiasLM, shards=2)


class MasksAtRandom(TinyLM):
    """Masks tokens at random in its step, before `self(...)`, drawing from NumPy and Python (as augmentations and
    masking schemes do)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        keep = torch.from_numpy(np.random.rand(*idx.shape) > random.random() / 2)
        return super().training_step((idx * keep, y), batch_idx)


def test_a_step_drawing_random_numbers_before_its_forward_trains_like_one_device():
    """Set-up runs the first step up to `self(...)` to find the forward's inputs: the step's draws there are given
    back, and training draws as on one device."""
    torch.manual_seed(0)
    reference = MasksAtRandom()
    model = copy.deepcopy(reference)
    runs = []
    for module, strategy in (reference, "auto"), (model, SpillingStrategy(memory_budget=BUDGETS[2])):
        random.seed(0), np.random.seed(0)
        runs.append(fit(module, strategy))
    torch.testing.assert_close(losses(runs[1]), losses(runs[0]), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class DictBatchLM(TinyLM):
    """Called with the whole batch as a dict, as `self.model(**batch)` calls a Hugging Face model with its labels:
    the first shard reads one entry of it."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch["idx"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        loss = F.cross_entropy(self({"idx": idx, "labels": y}).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, y = batch
        self.log("val_loss", F.cross_entropy(self({"idx": idx, "labels": y}).flatten(0, 1), y.flatten()))


def test_a_dict_batch_of_which_the_first_shard_reads_one_entry_trains_like_one_device():
    check_spilled_like_one_device(DictBatchLM, shards=5)


class MaskedAttentionLM(TinyLM):
    """Attention with an additive padding mask that no gradient flows into, made once and read in every shard, as
    Hugging Face models pass theirs: attention takes another kernel for a mask that needs a gradient."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(idx.shape, dtype=torch.float).masked_fill(idx == 0, -1e4)[:, None, None, :]
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            q = block.fc(block.norm(x))[:, None]
            x = x + F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[:, 0]
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return self.head(x)


def test_a_value_without_a_gradient_crossing_shards_is_computed_bit_for_bit_as_on_one_device():
    """A value that needs no gradient in the whole model needs none in the next shard either (the shards' first
    forward runs with autograd, as the recompute does): before, the mask needed one there, attention took another
    kernel, the losses were a rounding apart and AdamW made that 1e-4 in the weights within a few steps."""
    torch.manual_seed(0)
    reference = MaskedAttentionLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto", gradient_clip_val=None, accumulate_grad_batches=1, max_steps=6)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5])
    trainer = fit(model, strategy, gradient_clip_val=None, accumulate_grad_batches=1, max_steps=6)
    assert len(strategy.shards) > 2
    assert losses(trainer) == losses(expected)
    for (name, x), y in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(x, y), name


class EndsWithACutPoint(TinyLM):
    """A CutPoint after every layer, the last one included (`cut_after(self.layers)` on a model that ends there)."""

    def __init__(self) -> None:
        super().__init__()
        self.last_cut = CutPoint()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.last_cut(super().forward(idx))


def test_a_cutpoint_with_no_work_after_it_is_left_out():
    """It cannot begin a shard (before, set-up failed: 'gave 5 stages instead of 6')."""
    check_spilled_like_one_device(EndsWithACutPoint, shards=5)


class BatchesRead(L.Callback):
    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        self.rows.append(batch[0][:, 0].tolist())


@pytest.mark.parametrize("budget", ["1GB", BUDGETS[2]], ids=["whole", "cut"])
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


@pytest.mark.parametrize("budget", ["1GB", BUDGETS[2]], ids=["whole", "cut"])
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


def test_a_forward_that_reads_a_buffer_it_changes_is_recomputed_as_it_ran():
    """Each shard's forward is recomputed for its backward: it reads the buffer (a count of calls) as the first run
    found it, and the first run's update stays."""
    torch.manual_seed(0)
    reference = CountingLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto")
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]))
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)
    assert model.calls == reference.calls


def test_a_model_that_fits_in_one_shard_runs_whole():
    """Not cut into traced segments: the model's own modules run, so a module's backward hook runs too (a traced
    segment keeps only the forward's tensor operations), and it trains like one device."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    hooked: dict[str, int] = {"reference": 0, "model": 0}
    for name, m in (("reference", reference), ("model", model)):
        m.blocks[2].register_full_backward_hook(lambda *_, name=name: hooked.update({name: hooked[name] + 1}))
    expected = fit(reference, "auto")
    strategy = SpillingStrategy(memory_budget=BUDGETS[1])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*backward hooks.*")
        trainer = fit(model, strategy)
    assert strategy.shards == [[0, 1, 2, 3, 4]] and len(strategy.segment_memory) == 1
    assert hooked["model"] == hooked["reference"] == 8  # 4 steps of 2 accumulated batches
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class SpillFiles(L.Callback):
    """The names of the files in the spill tier under ``folder`` after each training batch."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen = folder, []

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(sorted(p.name for p in self.folder.rglob("*.bin")))


@pytest.mark.parametrize("shards", [1, 5])
def test_only_a_model_cut_into_shards_is_spilled(tmp_path, shards):
    """A model that fits its budget in one shard stays in the device's memory, as in plain training: nothing of it
    goes to the spill tier (here the disk); one cut into shards has every shard there between its turns."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto")
    files = SpillFiles(tmp_path)
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[shards], spill_dir=tmp_path), callbacks=[files])
    assert len(files.seen) == 8
    if shards == 1:
        assert files.seen == [[]] * 8
    else:
        assert all({f"shard{k}.params.bin" for k in range(shards)} <= set(seen) for seen in files.seen)
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class OutOfMemoryWhole(TinyLM):
    """A model whose whole forward on a full batch does not fit the device: it runs out of memory with autograd on
    (tracing it is not running it, and its traced segments, run one at a time, do not call this forward)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and idx.shape[0] > 2 and not torch.compiler.is_compiling():
            raise torch.OutOfMemoryError("the whole model's activations do not fit")
        return super().forward(idx)


def test_a_model_whose_whole_forward_runs_out_of_memory_is_cut():
    torch.manual_seed(0)
    strategy = SpillingStrategy(memory_budget=BUDGETS[1])
    trainer = fit(OutOfMemoryWhole(), strategy)
    assert strategy.shards == [[0, 1, 2, 3, 4]] and len(strategy.segment_memory) == 5
    assert len(losses(trainer)) == 8  # 4 steps of 2 accumulated batches


def test_bf16_mixed_trains_like_one_device():
    """The recomputed forwards run under the autocast of their first run."""
    torch.manual_seed(0)
    reference = TinyLM(dropout=0.1)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit(reference, "auto", precision="bf16-mixed")
    torch.manual_seed(1)
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), precision="bf16-mixed")
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_validate_alone_plans_for_a_forward_only():
    """`trainer.validate` alone holds no gradients, optimizer state or backward's activations: at a batch whose
    training would not fit the budget (training at batch 8 takes 5 shards of it), it validates as one device does."""
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    loader = DataLoader(token_dataset(64), batch_size=32)
    options: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5])
    validated = L.Trainer(strategy=strategy, **options).validate(model, loader, verbose=False)
    expected = L.Trainer(**options).validate(reference, loader, verbose=False)
    assert validated == expected


class GradNormLoggingLM(TinyLM):
    """Logs every gradient's norm before each step: with Lightning's `grad_norm` (``spilled=False``) or ours."""

    def __init__(self, spilled: bool) -> None:
        super().__init__()
        self.norm_of = lightning_varuna.grad_norm if spilled else lightning_grad_norm
        self.logged: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = self.norm_of(self, 2)
        self.log_dict(norms)
        self.logged.append({name: float(norm) for name, norm in norms.items()})


@pytest.mark.parametrize("clip", [0.5, None], ids=["clipped", "not-clipped"])
def test_grad_norm_sees_the_spilled_gradients_as_one_device(clip):
    """In ``on_before_optimizer_step`` a spilled parameter holds no ``.grad``: `lightning_varuna.grad_norm` logs
    what Lightning's `grad_norm` logs on one device, every parameter's norm and the total, after accumulation."""
    torch.manual_seed(0)
    model, reference = GradNormLoggingLM(spilled=True), GradNormLoggingLM(spilled=False)
    reference.load_state_dict(model.state_dict())
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), gradient_clip_val=clip)
    fit(reference, "auto", gradient_clip_val=clip)
    assert len(model.trainer.strategy.shards) == 5
    assert len(model.logged) == 4 and model.logged[0].keys() == reference.logged[0].keys()
    for spilled, plain in zip(model.logged, reference.logged):
        assert spilled == pytest.approx(plain, rel=1e-5)


class WideMLP(MLP):
    """Six wide layers with a CutPoint after each but the last: at 512 rows, each activation between them is as
    large as two layers' weights."""

    def __init__(self) -> None:
        super().__init__(256, 6)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]).square().mean())


def test_a_forward_only_run_holds_only_the_activations_still_to_be_read():
    """Validate and predict alone let each activation between shards go once the next shard has read it: a budget
    too small for all five at once (2.6 MB) but roomy for two runs them, cut, as one device does."""
    torch.manual_seed(0)
    model, loader = WideMLP(), DataLoader(TensorDataset(torch.randn(1024, 256)), batch_size=512)
    options: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    strategy = SpillingStrategy(memory_budget="2MB")
    trainer = L.Trainer(strategy=strategy, **options)
    validated = trainer.validate(model, loader, verbose=False)
    assert len(strategy.shards) > 1
    predicted = trainer.predict(model, loader)
    plain = L.Trainer(**options)
    assert validated == plain.validate(model, loader, verbose=False)
    torch.testing.assert_close(predicted, plain.predict(model, loader), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (2048, 2048),
        (2e9, 2 * 10**9),
        ("2e9", 2 * 10**9),
        ("512MB", 512 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5 GB", 15 * 10**8),
    ],
)
def test_memory_budget_sizes(size, expected):
    assert parse_bytes(size) == expected


@pytest.mark.parametrize("size", [True, "lots", "0MB", -1, [1]])
def test_a_bad_memory_budget_is_named(size):
    with pytest.raises((TypeError, ValueError), match=r"`memory_budget="):
        parse_bytes(size)


class LossScales(L.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]


def fp16_with_scale(init_scale: float) -> MixedPrecision:
    """``16-mixed`` as on CUDA, with a CPU grad scaler (Lightning offers the CPU bf16 only)."""
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))


class FusedAdamLM(TinyLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)  # it unscales its gradients itself


@pytest.mark.parametrize("budget", [BUDGETS[5], BUDGETS[1]], ids=["spilled", "fits"])
@pytest.mark.parametrize("model_class", [TinyLM, FusedAdamLM])
def test_fp16_loss_scaling_skips_the_steps_one_device_skips(budget, model_class):
    """``16-mixed``: the first scales overflow some shard's gradients, and the spilled run skips the same steps and
    backs off the scale as one device does (the overflow's gradients dropped, not summed into the next step's), with
    its losses and weights; gradients unscaled before they are clipped and accumulated over two batches. A fused
    optimizer (which Lightning does not let clip) gets the spilled gradients unscaled too."""
    torch.manual_seed(0)
    reference = model_class()
    model = copy.deepcopy(reference)
    expected_scales, scales = LossScales(), LossScales()
    options: dict[str, Any] = {"max_steps": 8}
    if model_class is FusedAdamLM:
        options["gradient_clip_val"] = None
    expected = fit(reference, "auto", plugins=[fp16_with_scale(2.0**18)], callbacks=[expected_scales], **options)
    strategy = SpillingStrategy(memory_budget=budget)
    trainer = fit(model, strategy, plugins=[fp16_with_scale(2.0**18)], callbacks=[scales], **options)

    assert (len(strategy.shards) > 1) == (budget == BUDGETS[5])
    assert expected_scales.scales[-1] == 2.0**15  # the first three steps overflowed and were skipped, not the others
    assert scales.scales == expected_scales.scales
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class CappedScaler(torch.amp.GradScaler):
    def update(self, new_scale: float | Tensor | None = None) -> None:
        super().update(new_scale)
        if self.get_scale() > 2.0**16:
            super().update(2.0**16)


def test_fp16_keeps_the_users_own_grad_scaler():
    """A grad scaler of the user's own class stays the plugin's, with what its class changes (a cap on the scale)."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected_scales, scales = LossScales(), LossScales()
    scaler = CappedScaler("cpu", init_scale=2.0**18)
    plugin = MixedPrecision("16-mixed", "cpu", scaler)
    expected_plugin = MixedPrecision("16-mixed", "cpu", CappedScaler("cpu", init_scale=2.0**18))
    fit(reference, "auto", max_steps=4, plugins=[expected_plugin], callbacks=[expected_scales])
    fit(model, SpillingStrategy(memory_budget=BUDGETS[2]), max_steps=4, plugins=[plugin], callbacks=[scales])
    assert plugin.scaler is scaler and isinstance(scaler, CappedScaler)
    assert scales.scales == expected_scales.scales
    assert max(scales.scales[1:]) == 2.0**16  # capped


def test_fp16_resumes_with_its_loss_scale(tmp_path):
    """A checkpoint taken after the overflowing steps keeps the backed-off scale: resumed at another budget, the
    spilled run goes on with the scales, losses and weights of an uninterrupted run on one device (plain Lightning,
    the same fp16 plugin, the same steps)."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected_scales, scales = LossScales(), LossScales()

    def fit_in_fp16(model: TinyLM, strategy: Any, ckpt_path: str | None = None, **kwargs: Any) -> L.Trainer:
        return fit(model, strategy, ckpt_path, plugins=[fp16_with_scale(2.0**18)], **kwargs)

    expected = fit_in_fp16(reference, "auto", max_steps=8, callbacks=[expected_scales])
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5)
    first = SpillingStrategy(memory_budget=BUDGETS[5])
    fit_in_fp16(copy.deepcopy(model), first, max_steps=5, callbacks=[saves])
    resumed = SpillingStrategy(memory_budget=BUDGETS[2])
    trainer = fit_in_fp16(model, resumed, saves.best_model_path, max_steps=8, callbacks=[scales])

    assert len(first.shards) > 1 and len(resumed.shards) > 1
    assert scales.scales == expected_scales.scales[10:]
    assert scales.scales[0] == 2.0**15  # the scale backed off by the first run's overflows
    torch.testing.assert_close(losses(trainer), losses(expected)[10:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


@pytest.mark.parametrize(
    ("name", "precision", "budget"),
    [
        ("bn_mlp", "64-true", 24_000),  # float inputs, BatchNorm
        ("bn_mlp", "bf16-true", 8_000),
        ("demo_transformer", "64-true", 600_000),  # its first forward makes its positional encoding
        ("demo_transformer", "bf16-true", 300_000),
    ],
)
def test_true_precisions_train_cut_like_one_device(name, precision, budget):
    """The model's parameters and its float batches are converted to the precision's dtype, the first batch (on which
    set-up finds and measures the segments) too, and the tensors its forward makes get that dtype at set-up and in the
    backward's recomputes as in the steps (before, those runs made float32 tensors)."""
    from real_models import build

    torch.manual_seed(0)
    reference, data = build(name)
    model = copy.deepcopy(reference)
    options = dict(max_steps=3, precision=precision, callbacks=[StepLosses()], logger=False, enable_progress_bar=False)
    expected = L.Trainer(accelerator="cpu", devices=1, **options)
    expected.fit(reference, DataLoader(data, batch_size=4))
    strategy = SpillingStrategy(memory_budget=budget)
    options["callbacks"] = [StepLosses()]
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, **options)
    trainer.fit(model, DataLoader(data, batch_size=4))
    assert len(strategy.shards) > 1
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)
    assert next(model.parameters()).dtype == {"64-true": torch.float64, "bf16-true": torch.bfloat16}[precision]


def test_checkpoints_are_written_a_shard_at_a_time_and_resume_exactly(tmp_path):
    """A checkpoint taken mid-epoch while the model is spilled (VarunaStrategy's sharded format, written shard by
    shard) holds what plain training holds at that step; a run resumed from it at another budget continues the
    epoch where it stopped, with the losses and weights of an uninterrupted run."""
    torch.manual_seed(0)
    reference = TinyLM(scheduler=True)
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    uninterrupted = copy.deepcopy(reference)
    folder = tmp_path / "checkpoints"
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
    plain = fit(reference, "auto", max_steps=2)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=tmp_path)
    fit(model, strategy, max_steps=2, callbacks=[saves])
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    written = open_complete(Storage(), str(folder / "epoch=0-step=2.ckpt")).version_url
    parts = [name for name in os.listdir(written) if name.endswith(".distcp")]
    assert len(parts) == len(strategy.shards) + 1, "a part per shard, and one for what stays on the device"
    saved = consolidate(str(folder / "epoch=0-step=2.ckpt"))
    torch.testing.assert_close(saved["state_dict"], reference.state_dict())
    torch.testing.assert_close(saved["optimizer_states"], [plain.optimizers[0].state_dict()])  # torch's numbering
    assert saved["global_step"] == 2 and saved["lr_schedulers"] == [
        plain.lr_scheduler_configs[0].scheduler.state_dict()
    ]

    expected = fit(uninterrupted, "auto", max_steps=4)
    path = str(folder / "epoch=0-step=2.ckpt")
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[2]), ckpt_path=path, max_steps=4)
    torch.testing.assert_close(losses(continued), losses(expected)[4:], rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, uninterrupted)


@pytest.mark.parametrize("model_class", [TinyLM, EmptyGroupTinyLM])
def test_a_consolidated_checkpoint_resumes_where_the_sharded_one_does(tmp_path, model_class):
    """`lightning-varuna consolidate`'s one file, of a checkpoint taken mid-epoch, resumes spilled and pipelined with
    the losses and weights of an uninterrupted run: its position in the data is read, and its optimizer state, as
    torch numbers it or (with a group of no parameters, which has no name to keep) by name."""
    torch.manual_seed(0)
    reference = model_class()
    model, spilled, pipelined = (copy.deepcopy(reference) for _ in range(3))
    folder = tmp_path / "checkpoints"
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=2, callbacks=[ModelCheckpoint(dirpath=folder)])
    consolidated = str(tmp_path / "model.ckpt")
    torch.save(consolidate(str(folder / "epoch=0-step=2.ckpt")), consolidated)
    by_name = "optimizer_states_by_name" in torch.load(consolidated, weights_only=False)
    assert by_name == (model_class is EmptyGroupTinyLM)
    expected = fit(reference, "auto", max_steps=4)
    for strategy, resumed in ((SpillingStrategy(memory_budget=BUDGETS[2]), spilled), (VarunaStrategy(), pipelined)):
        continued = fit(resumed, strategy, ckpt_path=consolidated, max_steps=4)
        torch.testing.assert_close(losses(continued), losses(expected)[4:], rtol=1e-5, atol=1e-6)
        assert_same_model(resumed, reference)


@pytest.mark.parametrize("consolidated", [False, True])
def test_a_resume_at_another_global_batch_warns_from_a_folder_or_its_consolidated_file(tmp_path, consolidated):
    """A checkpoint records its run's global batch (8 rows here), and a resumed run with another says so, read from
    the checkpoint's folder or from its consolidated file (which dropped it before)."""
    torch.manual_seed(0)
    model = TinyLM()
    folder = tmp_path / "checkpoints"
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=2, callbacks=[ModelCheckpoint(dirpath=folder)])
    path = str(folder / "epoch=0-step=2.ckpt")
    if consolidated:
        torch.save(consolidate(path), tmp_path / "model.ckpt")
        path = str(tmp_path / "model.ckpt")
    smaller = DataLoader(token_dataset(64), batch_size=4)
    with pytest.warns(UserWarning, match="trained with a global batch of 8 rows; this run's is 4"):
        fit(model, VarunaStrategy(), ckpt_path=path, loader=smaller, max_steps=3)


def test_a_consolidated_checkpoint_resumes_a_plain_trainer_with_its_parameter_groups(tmp_path):
    """Consolidated, a spilled checkpoint numbers its optimizer state as torch does for the module's own parameter
    groups: a plain Trainer resumes from it and trains on as if never stopped."""
    torch.manual_seed(0)
    reference = GroupedTinyLM()
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    folder = tmp_path / "checkpoints"
    fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=4, callbacks=[ModelCheckpoint(dirpath=folder)])
    consolidated = str(tmp_path / "model.ckpt")
    torch.save(consolidate(str(folder / "epoch=0-step=4.ckpt")), consolidated)  # the end of the epoch
    expected = fit(reference, "auto", max_steps=6)
    continued = fit(resumed, "auto", ckpt_path=consolidated, max_steps=6)
    torch.testing.assert_close(losses(continued), losses(expected)[8:], rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, reference)


@pytest.mark.parametrize(
    ("strategy", "interrupted"), [(SpillingStrategy, False), (VarunaStrategy, False), (SpillingStrategy, True)]
)
def test_last_resumes_a_plain_runs_last_file_and_replaces_it(tmp_path, strategy, interrupted):
    """``ckpt_path="last"`` in the folder of a plain run's ``ModelCheckpoint(save_last=True)`` resumes from its
    ``last.ckpt`` file (it trained from scratch instead), and the strategy's own ``last.ckpt`` folder then takes
    that file's place (a folder cannot be written where the file is); where a save there set the file aside and
    never committed, "last" resumes from the file set aside. (VarunaStrategy reads the next epoch through
    Lightning's distributed sampler, which shuffles: the same batches as one device's in another order.)"""
    torch.manual_seed(0)
    reference = TinyLM(scheduler=True)
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    folder = tmp_path / "checkpoints"
    fit(model, "auto", max_steps=4, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)])
    assert (folder / "last.ckpt").is_file()
    if interrupted:  # as a save that set the file aside and stopped while writing leaves the folder
        (folder / "last.ckpt").rename(folder / "last.ckpt.replaced")
        (folder / "last.ckpt" / "v00000000000000000001").mkdir(parents=True)
    expected = fit(reference, "auto", max_steps=6)
    continued = fit(
        resumed, strategy(), "last", max_steps=6, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)]
    )
    assert len(losses(continued)) == 4  # the second epoch's batches
    if strategy is SpillingStrategy:
        torch.testing.assert_close(losses(continued), losses(expected)[8:], rtol=1e-5, atol=1e-6)
        assert_same_model(resumed, reference)
    assert (folder / "last.ckpt").is_dir() and sorted(p.name for p in folder.iterdir() if "last" in p.name) == [
        "last.ckpt"
    ]
    assert open_complete(Storage(), str(folder / "last.ckpt")).global_step == 6


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
    expected = fit(reference, SpillingStrategy(memory_budget=BUDGETS[2]), loader=loader(), callbacks=[read], **options)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit(model, SpillingStrategy(memory_budget=BUDGETS[2]), loader=loader(), callbacks=[saves], max_steps=2, **options)
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
        return VarunaStrategy() if strategy == "varuna" else SpillingStrategy(memory_budget=BUDGETS[2])

    read, resumed_read = BatchesRead(), BatchesRead()
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    expected = fit(reference, make(), callbacks=[read, saves], **options)
    continued = fit(model, make(), str(tmp_path / "epoch=0-step=3.ckpt"), callbacks=[resumed_read], **options)
    assert resumed_read.rows == read.rows[3:]
    torch.testing.assert_close(losses(continued), losses(expected)[3:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


@pytest.mark.parametrize("writer", ["varuna", "spilled"])
def test_a_checkpoint_of_an_optimizer_without_the_frozen_parameters_resumes_spilled(tmp_path, writer):
    """A frozen block left out of the optimizer (a frozen backbone, LoRA's base weights) has no optimizer state in
    the checkpoint; the spilled resume asked for it, and refused its own checkpoint as written "with different
    optimizers"."""
    torch.manual_seed(0)
    reference = FrozenEmbeddingLM()
    reference.blocks[0].requires_grad_(False)
    model = copy.deepcopy(reference)
    options: dict[str, Any] = {"limit_val_batches": 0, "max_steps": 6, "accumulate_grad_batches": 1}
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    writing = VarunaStrategy() if writer == "varuna" else SpillingStrategy(memory_budget=BUDGETS[5])
    expected = fit(reference, writing, callbacks=[saves], **options)
    resumed = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), str(tmp_path / "epoch=0-step=3.ckpt"), **options)
    torch.testing.assert_close(losses(resumed), losses(expected)[3:], rtol=1e-5, atol=1e-6)
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
        return VarunaStrategy() if strategy == "varuna" else SpillingStrategy(memory_budget=BUDGETS[2])

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
        SpillingStrategy(memory_budget=BUDGETS[2]),
        loader=loader(),
        callbacks=[read],
        max_epochs=2,
        **options,
    )
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(model, SpillingStrategy(memory_budget=BUDGETS[2]), loader=loader(), callbacks=[saves], max_epochs=1, **options)
    path = str(tmp_path / "last.ckpt")
    continued = fit(
        model,
        SpillingStrategy(memory_budget=BUDGETS[2]),
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
        fit(model, SpillingStrategy(memory_budget=BUDGETS[2]), callbacks=[saves], **options)
    path = str(tmp_path / "on_exception.ckpt")
    continued = fit(model, SpillingStrategy(memory_budget=BUDGETS[2]), ckpt_path=path, **options)
    torch.testing.assert_close(losses(continued), losses(expected)[3:], rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_checkpoint_saved_after_fit_ended_by_max_epochs_resumes_with_the_next_epoch(tmp_path):
    """`save_checkpoint` after `fit(max_epochs=1)` (the model whole again), then `fit(max_epochs=2)` from it at
    another budget: the second epoch is trained, as in one uninterrupted two-epoch run."""
    torch.manual_seed(0)
    reference = TinyLM(scheduler=True)
    model, resumed = copy.deepcopy(reference), copy.deepcopy(reference)
    expected = fit(reference, "auto", max_steps=-1, max_epochs=2)
    first = fit(model, SpillingStrategy(memory_budget=BUDGETS[2], spill_dir=tmp_path), max_steps=-1, max_epochs=1)
    first.save_checkpoint(tmp_path / "end.ckpt")
    path = str(tmp_path / "end.ckpt")
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[5]), ckpt_path=path, max_steps=-1, max_epochs=2)
    assert len(losses(continued)) == len(losses(first)) == 8
    torch.testing.assert_close(losses(first) + losses(continued), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, reference)


def test_a_plain_lightning_checkpoint_resumes_spilled(tmp_path):
    """A checkpoint file of plain single-device training loads a shard at a time; the run continues as plain
    Lightning continues from it (which restarts an interrupted epoch's data)."""
    torch.manual_seed(0)
    reference = TinyLM()
    resumed, resumed_plainly = copy.deepcopy(reference), copy.deepcopy(reference)
    plain = fit(reference, "auto", max_steps=2)
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    path = str(tmp_path / "plain.ckpt")
    expected = fit(resumed_plainly, "auto", ckpt_path=path, max_steps=4)
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[2]), ckpt_path=path, max_steps=4)
    torch.testing.assert_close(losses(continued), losses(expected), rtol=1e-5, atol=1e-6)
    assert len(losses(continued)) == 4
    assert_same_model(resumed, resumed_plainly)


class BuiltInConfigureModel(TinyLM):
    """TinyLM whose layers are built in `configure_model`, as large models are (on the meta device there)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.lr, self.scheduler = 0.05, False
        self.acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro")
        self.val_f1 = torchmetrics.classification.MulticlassF1Score(VOCAB, average="macro")
        self.built_on: torch.device | None = None

    def configure_model(self) -> None:
        if self.built_on is not None:
            return
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(5))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.built_on = self.emb.weight.device


class SaveAtStart(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_a_model_built_in_configure_model_is_materialized_shard_by_shard(tmp_path, disk):
    """`configure_model` runs on the meta device; set-up gives each segment memory and its layers' initial values
    (`reset_parameters`) as it measures it, and spills it; training then matches plain training from the same
    initial weights (read from a checkpoint taken at the start)."""
    torch.manual_seed(0)
    model = BuiltInConfigureModel()
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=tmp_path if disk else None)
    trainer = fit(model, strategy, callbacks=[SaveAtStart(tmp_path / "start.ckpt")])
    assert model.built_on == torch.device("meta") and len(strategy.shards) == 5
    reference = BuiltInConfigureModel()
    reference.configure_model()
    initial = consolidate(str(tmp_path / "start.ckpt"))["state_dict"]
    assert all(value.abs().sum() > 0 for name, value in initial.items() if "weight" in name)
    reference.load_state_dict(initial)
    expected = fit(reference, "auto")
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_meta_module_without_reset_parameters_is_named():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.factor = nn.Parameter(torch.ones(DIM))

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return x * self.factor

    class WithScale(BuiltInConfigureModel):
        def configure_model(self) -> None:
            super().configure_model()
            self.blocks[2] = Scale()

    with pytest.raises(TypeError, match=r"`blocks\.2` \(Scale\) was built on the meta device .*reset_parameters"):
        fit(WithScale(), SpillingStrategy(memory_budget=BUDGETS[5]))


def test_a_metric_built_in_configure_model_is_named():
    """A torchmetrics metric built on the meta device has lost its starting values: set-up says to build it in
    `__init__` (as `BuiltInConfigureModel` does, whose metric trains on the device)."""

    class MetricInConfigureModel(BuiltInConfigureModel):
        def configure_model(self) -> None:
            super().configure_model()
            self.acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro")

    with pytest.raises(ValueError, match=r"metric `acc` was built in `configure_model`.*Build metrics in `__init__`"):
        fit(MetricInConfigureModel(), SpillingStrategy(memory_budget=BUDGETS[5]))


def test_by_name_and_validate_and_predict():
    torch.manual_seed(0)
    model = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="spilling", logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, SpillingStrategy)
    loader = DataLoader(token_dataset(16), batch_size=8)
    predicted = trainer.predict(model, loader)
    expected = [model(batch[0]).argmax(-1) for batch in loader]
    assert all(torch.equal(a, b) for a, b in zip(predicted, expected))


# ------------------------------------------------------------------------------------------------- bad input
def test_a_model_compiled_whole_is_refused():
    with pytest.raises(ValueError, match=r"compiled whole .*self\.net = torch\.compile\(net\)"):
        fit(torch.compile(TinyLM()), SpillingStrategy(memory_budget=BUDGETS[2]))


@pytest.mark.parametrize("averaging", [StochasticWeightAveraging, EMAWeightAveraging], ids=["swa", "ema"])
def test_weight_averaging_needs_the_model_on_the_device(averaging):
    """Averaging callbacks copy every parameter after each step: refused for a spilled model, with what to change;
    a model that stays on the device in one shard averages as plain Lightning does."""
    kwargs = {"swa_lrs": 0.01, "swa_epoch_start": 1} if averaging is StochasticWeightAveraging else {}
    with pytest.raises(ValueError, match=rf"`{averaging.__name__}` averages every parameter .*2 shard"):
        fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[2]), callbacks=[averaging(**kwargs)])
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    fit(reference, "auto", callbacks=[averaging(**kwargs)], max_steps=-1, max_epochs=3)
    fit(model, SpillingStrategy(memory_budget=BUDGETS[1]), callbacks=[averaging(**kwargs)], max_steps=-1, max_epochs=3)
    assert_same_model(model, reference)


class NoGradBlockLM(TinyLM):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0](self.blocks[0](self.emb(idx), torch.ones(())))
        with torch.no_grad():
            centre = x.mean(0)
        return self.head(x - centre)


def test_a_grad_mode_block_in_the_forward_is_named_with_what_to_use():
    with pytest.raises(RuntimeError, match=r"a `with torch\.no_grad\(\):` .*Use `\.detach\(\)`"):
        fit(NoGradBlockLM(), SpillingStrategy(memory_budget=BUDGETS[5]))


class CheckpointedLlama(L.LightningModule):
    """Hugging Face's gradient checkpointing, reentrant, with a CutPoint after each layer: inside the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2
        )
        self.model = LlamaForCausalLM(config)
        cut_after(self.model.model.layers)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_parameter_outside_the_optimizer_is_planned_without_gradient_or_state():
    """A frozen block the optimizer does not hold takes its parameters' bytes alone, not 4x (a LoRA model's base
    weights were planned as if trained, in several times the shards it needs); a trained one takes 4x."""
    model = FrozenEmbeddingLM()
    model.blocks[1].requires_grad_(False)
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=1)
    memory = trainer.strategy.segment_memory
    frozen, trained = (sum(4 * p.numel() for p in model.blocks[i].parameters()) for i in (1, 2))
    assert (memory[1].state_bytes, memory[2].state_bytes) == (frozen, 4 * trained)


def test_cutpoints_inside_a_reentrant_checkpoint_are_named_with_what_to_use():
    """torch's split merges their stages without an error (ours said that a stage had no computation)."""
    pytest.importorskip("transformers")
    trainer = L.Trainer(accelerator="cpu", strategy=SpillingStrategy(memory_budget="100KB"), max_steps=1, logger=False)
    data = DataLoader(torch.randint(1, 50, (8, 8)), batch_size=8)
    with pytest.raises(RuntimeError, match=r"a reentrant `torch\.utils\.checkpoint`.*`use_reentrant=False`"):
        trainer.fit(CheckpointedLlama(), data)


class FrozenEmbeddingLM(TinyLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:  # the trainable parameters only
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def test_finetuning_that_unfreezes_parameters_outside_the_optimizer_is_refused():
    """`BaseFinetuning` finds what it unfreezes among the optimizer's parameters by their values, which spilled ones
    do not hold: an optimizer over the trainable parameters only is refused, with what to build instead."""
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    model = FrozenEmbeddingLM()
    model.backbone = model.blocks[0]  # what BackboneFinetuning freezes, then unfreezes
    with pytest.raises(ValueError, match=r"`BackboneFinetuning` would add .*over all of the model's parameters"):
        fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), callbacks=[finetuning])


class RootRunningMeanLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0](self.blocks[0](self.emb(idx), torch.ones(())))
        self.mean.copy_(0.5 * self.mean + 0.5 * x.mean((0, 1)).detach())
        return self.head(x - self.mean)


def test_a_buffer_of_the_model_itself_changed_in_place_is_named_with_what_to_do():
    with pytest.raises(TypeError, match=r"changes a buffer of the model itself in place .*in a submodule"):
        fit(RootRunningMeanLM(), SpillingStrategy(memory_budget=BUDGETS[5]))


@pytest.mark.parametrize("budget", ["lots", "12 parsecs", 0, "-1MB"])
def test_a_budget_that_is_not_a_size(budget):
    with pytest.raises(ValueError, match="memory_budget"):
        SpillingStrategy(memory_budget=budget)


def test_more_than_one_device_points_elsewhere():
    with pytest.raises(ValueError, match="VarunaStrategy.*MultiModelTrainer"):
        L.Trainer(accelerator="cpu", devices=2, strategy=SpillingStrategy())


def test_a_spill_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(OSError, match=r"spill_dir=.*file/spill.*is not a folder this process can write"):
        fit(model, SpillingStrategy(memory_budget=BUDGETS[2], spill_dir=blocker / "spill"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name])


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 256 KiB filesystem (tmpfs) for a `spill_dir`; skips where this process may not mount one (not root)."""
    path = tmp_path / "small"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small filesystem: {mounted.stderr.decode().strip()}")
    yield path
    # Lazily: a model trained there keeps its parameters mapped from its (removed) spill files until it is freed.
    subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """Write a file on ``disk`` until it is full (but for about ``leave`` bytes), as another program could."""
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while shutil.disk_usage(disk).free > leave:
            f.write(b"x" * 4096)
            f.flush()


def test_a_spill_dir_without_room_fails_at_set_up(small_disk):
    fill(small_disk, leave=16 * 1024)
    with pytest.raises(OSError, match=r"spill_dir=.*small.* has 1[26]\.0 KiB free, but .* need up to 2\d\.\d KiB"):
        fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=small_disk), max_steps=1)
    assert not list(small_disk.rglob("*.bin"))


class FillDisk(L.Callback):
    """Fill ``disk`` after optimizer step ``step``."""

    def __init__(self, disk: Path, step: int) -> None:
        self.disk, self.step = disk, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not (self.disk / "filler").exists():
            fill(self.disk)


def test_a_spill_dir_that_fills_up_fails_with_the_path_and_loses_nothing(tmp_path, small_disk):
    """The spill write that finds the disk full fails the fit naming the file and the bytes; the newest
    checkpoint is complete and training resumes from it exactly (here spilled to host memory)."""
    torch.manual_seed(0)
    model = TinyLM()
    resumed, uninterrupted = copy.deepcopy(model), copy.deepcopy(model)
    folder = tmp_path / "checkpoints"
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=small_disk)
    with pytest.raises(OSError, match=r"Cannot spill \d+ bytes to `.*small/spill-.*\.bin` \(No space left on device\)"):
        fit(model, strategy, max_steps=4, callbacks=[saves, FillDisk(small_disk, step=2)])
    newest, _ = find_newest(Storage(), [str(folder)])
    assert newest is not None and newest.global_step in (1, 2)
    expected = fit(uninterrupted, "auto", max_steps=4)
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[5]), ckpt_path=newest.url, max_steps=4)
    batches = 2 * newest.global_step  # two batches a step
    torch.testing.assert_close(losses(continued), losses(expected)[batches:], rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, uninterrupted)


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
    fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[2]), mid_epoch, max_steps=2, accumulate_grad_batches=1)
    spilled = restarts()
    fit(TinyLM(), "auto", mid_epoch, max_steps=2, accumulate_grad_batches=1)
    assert [spilled, restarts()] == [0, 1]
