"""SpillingStrategy trains exactly like plain single-device training, within its memory budget: per-step losses,
validation loss and weights at 1, 3 and 5 shards, in host memory and on disk, with models that draw random numbers,
read dicts, mask attention or update buffers, or compute weights (pruned, weight-normalized); a model that fits runs
whole; gradient norms seen as on one device;
and runs of the forward alone (validate, predict) as one device runs them."""

from __future__ import annotations

import copy
import random
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from models import DIM, VOCAB, CountingLM, TinyLM, token_dataset
from spilled_runs import BUDGETS, assert_same_model, fit, losses
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_varuna
from lightning_varuna import CutPoint, SpillingStrategy
from lightning_varuna.demos import MLP


class SGDTinyLM(TinyLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("model_class", [TinyLM, SGDTinyLM], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("num_shards", [1, 3, 5])
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


def _prune(model: TinyLM) -> None:
    torch.nn.utils.prune.l1_unstructured(model.blocks[1].fc, "weight", amount=0.3)
    torch.nn.utils.prune.random_unstructured(model.blocks[3].fc, "bias", amount=0.5)


def _normalize_weights(model: TinyLM) -> None:
    torch.nn.utils.parametrizations.weight_norm(model.blocks[0].fc)
    torch.nn.utils.parametrizations.weight_norm(model.blocks[2].fc)


@pytest.mark.parametrize("reparametrize", [_prune, _normalize_weights], ids=["pruned", "weight-norm"])
def test_weights_pruned_or_parametrized_before_fit_train_cut_as_on_one_device(reparametrize):
    """A weight computed in the forward from others (the masks of `torch.nn.utils.prune`, a `weight_norm`
    parametrization) is traced with it: cut in 5 shards, the model trains as one device trains it."""
    models = []
    for _ in range(2):  # a pruned module cannot be deep-copied: built twice alike
        torch.manual_seed(0)
        models.append(TinyLM())
        reparametrize(models[-1])
    reference, model = models
    expected = fit(reference, "auto")
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]))
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class RowBiasLM(TinyLM):
    """A model with its batch size built in: a learned bias per row of a batch of 8."""

    def __init__(self) -> None:
        super().__init__()
        self.row_bias = nn.Parameter(torch.randn(8, 1, VOCAB))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.row_bias


def check_spilled_like_one_device(model_class: Callable[[], L.LightningModule], shards: int) -> None:
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


class FreezesItsNormLM(TinyLM):
    """A BatchNorm over each row's mean state before the head, put in eval mode as each training epoch starts:
    frozen statistics while the rest trains, as fine-tuning does (after set-up, which traced it in train mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.through_blocks(self.emb(idx), idx)
        return self.head(x + self.norm(x.mean(1)).unsqueeze(1))

    def on_train_epoch_start(self) -> None:
        self.norm.eval()


def test_a_module_a_hook_puts_in_eval_mode_trains_so_like_one_device():
    """Each module's mode, not only the model's, picks the trace a step runs: a BatchNorm a hook freezes normalizes
    with its running statistics and keeps them, as on one device."""
    check_spilled_like_one_device(FreezesItsNormLM, shards=5)


class NormedStemLM(TinyLM):
    """A BatchNorm over the embeddings, the two also held as ``self.stem`` (as Lightning's `BackboneFinetuning`
    reads ``self.backbone``): a module under two names, whose buffers torch.export's modules read by the other."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)
        self.stem = nn.ModuleList([self.emb, self.norm])
        self.norm.train(not frozen)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.through_blocks(self.norm(self.emb(idx).transpose(1, 2)).transpose(1, 2), idx))


@pytest.mark.parametrize("frozen", [False, True], ids=["training", "frozen"])
def test_a_module_held_under_two_names_trains_like_one_device(frozen):
    """Its BatchNorm's running statistics are the model's, read and updated as on one device (in train mode, once
    per forward, though its shard computes the forward again in backward; in eval mode, read as they are)."""
    check_spilled_like_one_device(lambda: NormedStemLM(frozen), shards=5)


def test_a_model_with_its_batch_size_built_in_trains_like_one_device():
    """Set-up finds the CutPoints on two rows of the first batch; a model that cannot run two rows is probed with
    the whole batch."""
    check_spilled_like_one_device(RowBiasLM, shards=5)


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
    for module, strategy in (reference, "auto"), (model, SpillingStrategy(memory_budget=BUDGETS[5])):
        random.seed(0), np.random.seed(0)
        runs.append(fit(module, strategy))
    torch.testing.assert_close(losses(runs[1]), losses(runs[0]), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_model_with_a_frozen_shard_trains_clipped_like_one_device(algorithm):
    """Two frozen blocks: a shard of them has no gradients to clip (clipping by value failed there, torch refusing an
    empty list of gradients)."""
    torch.manual_seed(0)
    reference = TinyLM()
    reference.blocks[:2].requires_grad_(False)
    model = copy.deepcopy(reference)
    clipped = {"gradient_clip_algorithm": algorithm, "gradient_clip_val": 0.05}
    runs = [fit(reference, "auto", **clipped), fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), **clipped)]
    assert len(runs[1].strategy.shards) >= 3, runs[1].strategy.shards
    torch.testing.assert_close(losses(runs[1]), losses(runs[0]), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


class ChangesItselfBeforeItsForward(TinyLM):
    """A step whose code before `self(...)` changes the module's state: it decays the learning rate by hand, counts
    its steps, keeps the steps it saw and marks its first."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_seen, self.batches = 0, []  # type: ignore[var-annotated]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.optimizers().param_groups[0]["lr"] *= 0.5  # type: ignore[union-attr]
        self.steps_seen += 1
        self.batches.append(batch_idx)
        if not hasattr(self, "first_step"):
            self.first_step = self.global_step
        return super().training_step(batch, batch_idx)


def test_a_step_changing_its_module_before_its_forward_trains_like_one_device():
    """What set-up's run of the first step up to `self(...)` changes of the module (its attributes, its optimizer's
    learning rate) is given back: training sees it as on one device."""
    torch.manual_seed(0)
    reference = ChangesItselfBeforeItsForward()
    model = copy.deepcopy(reference)
    runs = [fit(reference, "auto"), fit(model, SpillingStrategy(memory_budget=BUDGETS[5]))]
    torch.testing.assert_close(losses(runs[1]), losses(runs[0]), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)
    assert (model.steps_seen, model.batches, model.first_step) == (8, list(range(8)), 0)
    assert runs[1].optimizers[0].param_groups[0]["lr"] == runs[0].optimizers[0].param_groups[0]["lr"]


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


def test_by_name_and_validate_and_predict():
    torch.manual_seed(0)
    model = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="spilling", logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, SpillingStrategy)
    loader = DataLoader(token_dataset(16), batch_size=8)
    predicted = trainer.predict(model, loader)
    expected = [model(batch[0]).argmax(-1) for batch in loader]
    assert all(torch.equal(a, b) for a, b in zip(predicted, expected))


def test_a_model_that_fits_the_budget_whole_but_not_in_half_of_it_runs_whole():
    """Alone on the device, a model has no next shard to fetch beside it: the whole budget is its room (it was cut
    and spilled where it fitted the budget but not half of it)."""
    torch.manual_seed(0)
    reference = TinyLM()
    measured = SpillingStrategy(memory_budget="1GiB")
    fit(copy.deepcopy(reference), measured)
    (whole,) = measured.segment_memory
    room = int(whole.need * 1.5)  # more than the model needs, less than twice it
    strategy = SpillingStrategy(memory_budget=measured.kept_bytes + room)
    model = copy.deepcopy(reference)
    trainer = fit(model, strategy)
    assert strategy.shards == [[0, 1, 2, 3, 4]] and len(strategy.segment_memory) == 1
    torch.testing.assert_close(losses(trainer), losses(fit(reference, "auto")), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)
