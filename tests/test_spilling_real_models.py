"""Models the project did not write (tests/real_models.py) train spilled exactly like on one device."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import RecordLosses
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_varuna import MultiModelTrainer, SpillingStrategy

pytest.importorskip("transformers", reason="the real-model tests train Hugging Face models: pip install transformers")
from real_models import RealModel, build  # noqa: E402

pytestmark = pytest.mark.slow  # Hugging Face and torchvision models

MODELS = ["bn_mlp", "resnet", "bert", "gpt2", "llama", "mixtral", "vit", "demo_transformer", "causal_encoder"]
STEPS, BATCH = 3, 4


def fit(
    model: L.LightningModule,
    data: object,
    strategy: object,
    steps: int = STEPS,
    callbacks: list[L.Callback] = (),
    ckpt_path: str | None = None,
    precision: str = "32-true",
) -> RecordLosses:
    record = RecordLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        callbacks=[record, *callbacks],
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=precision,
    )
    trainer.fit(model, DataLoader(data, batch_size=BATCH), ckpt_path=ckpt_path)
    return record


def budget_for_two_or_more_shards(model: L.LightningModule, data: object) -> int:
    """A budget that fits the largest segment (and the next arriving, where that is still less than the whole model
    needs) but not the whole model in one shard."""
    roomy = SpillingStrategy(memory_budget="64GB")
    fit(copy.deepcopy(model), data, roomy, steps=1)
    (whole,) = roomy.segment_memory  # the model fits: it runs whole, measured as one
    needs_whole = roomy.kept_bytes + whole.need
    # Just under what the whole model needs, and nothing set aside for prefetching: the model is cut, and each of
    # its segments measured.
    cut = SpillingStrategy(memory_budget=needs_whole - 1, prefetch=False)
    fit(copy.deepcopy(model), data, cut, steps=1)
    largest = max(s.need for s in cut.segment_memory)
    prefetching = cut.kept_bytes + 2 * largest
    if prefetching < needs_whole:
        return prefetching
    # The whole model fits beside a next segment arriving (bn_mlp, resnet): half-way between the smallest budget
    # that trains it cut and what it needs whole, the largest segment on the device alone.
    return (cut.kept_bytes + largest + needs_whole) // 2


def assert_same_weights(model: L.LightningModule, reference: L.LightningModule, label: str = "") -> None:
    """Every entry of the state dicts equal: floats within tolerance, the rest (step counts) exactly."""
    for (key, value), expected_value in zip(model.state_dict().items(), reference.state_dict().values()):
        where = f"{label} {key}".strip()
        if value.is_floating_point():
            torch.testing.assert_close(value, expected_value, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
        else:
            assert torch.equal(value, expected_value), where


@pytest.mark.parametrize("name", MODELS)
def test_real_model_trains_spilled_like_one_device(tmp_path, name):
    model, data = build(name)
    reference = copy.deepcopy(model)
    budget = budget_for_two_or_more_shards(model, data)
    expected = fit(reference, data, "auto")
    strategy = SpillingStrategy(memory_budget=budget, spill_dir=tmp_path)
    spilled = fit(model, data, strategy)
    assert len(strategy.shards) >= 2, strategy.shards
    torch.testing.assert_close(torch.tensor(spilled.losses), torch.tensor(expected.losses), rtol=1e-4, atol=1e-5)
    assert_same_weights(model, reference)


@pytest.mark.parametrize("name", ["bert", "gpt2", "gpt2_own_loss", "gpt2_float_logits"])
def test_real_model_trains_spilled_in_bf16_bit_for_bit_as_on_one_device(tmp_path, name):
    """bf16-mixed computes what one device computes, bit for bit: a value a shard receives is cast to bf16 anew by
    each layer that reads it (BERT's query, key and value), as on one device; the float32 logits of Hugging Face's
    own loss, and of a LightningModule's forward, too (traced in float32, where that cast was a no-op). (Autocast
    keeps one cast of a leaf that needs a gradient, which the received value was: the three gradients were summed in
    bf16, 1e-5 off in the weights after four steps.)"""
    model, data = build(name)
    reference = copy.deepcopy(model)
    budget = budget_for_two_or_more_shards(model, data)
    expected = fit(reference, data, "auto", precision="bf16-mixed")
    strategy = SpillingStrategy(memory_budget=budget, spill_dir=tmp_path)
    spilled = fit(model, data, strategy, precision="bf16-mixed")
    assert len(strategy.shards) >= 2, strategy.shards
    assert spilled.losses == expected.losses
    for (key, value), expected_value in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected_value), key


@pytest.mark.parametrize("name", ["bn_mlp", "bert", "gpt2"])
def test_real_model_resumes_spilled_from_a_mid_epoch_checkpoint(tmp_path, name):
    """A checkpoint written a shard at a time in the middle of an epoch (BatchNorm's statistics and step count,
    a tied head, dict batches) resumes at another budget as if training had not stopped."""
    model, data = build(name)
    reference, resumed = copy.deepcopy(model), copy.deepcopy(model)
    budget = budget_for_two_or_more_shards(model, data)
    expected = fit(reference, data, "auto", steps=4)
    saves = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    fit(model, data, SpillingStrategy(memory_budget=budget, spill_dir=tmp_path), steps=2, callbacks=[saves])
    path = str(tmp_path / "checkpoints" / "epoch=0-step=2.ckpt")
    continued = fit(resumed, data, SpillingStrategy(memory_budget=2 * budget), steps=4, ckpt_path=path)
    torch.testing.assert_close(torch.tensor(continued.losses), torch.tensor(expected.losses[2:]), rtol=1e-4, atol=1e-5)
    assert_same_weights(resumed, reference)


@pytest.mark.parametrize("name", MODELS)
def test_real_model_that_fits_runs_whole_and_resumes_a_cut_runs_checkpoint(tmp_path, name):
    """With the default budget the model fits in one shard and trains whole (untraced) like one device, from the
    checkpoint a run cut into two or more shards wrote as its fit ended."""
    model, data = build(name)
    reference, resumed = copy.deepcopy(model), copy.deepcopy(model)
    budget = budget_for_two_or_more_shards(model, data)
    expected = fit(reference, data, "auto", steps=4)
    saves = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    cut = SpillingStrategy(memory_budget=budget)
    fit(model, data, cut, steps=2, callbacks=[saves])
    path = str(tmp_path / "checkpoints" / "epoch=0-step=2.ckpt")
    whole = SpillingStrategy()
    continued = fit(resumed, data, whole, steps=4, ckpt_path=path)
    assert len(cut.shards) >= 2 and len(whole.shards) == 1 and len(whole.segment_memory) == 1
    torch.testing.assert_close(torch.tensor(continued.losses), torch.tensor(expected.losses[2:]), rtol=1e-4, atol=1e-5)
    assert_same_weights(resumed, reference)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_real_model_run_whole_trains_bit_for_bit_as_on_one_device(name):
    """A model that fits runs whole as its own forward, as on one device, Hugging Face's key/value cache included
    (computed or not, attention rounds differently: a key bias, whose gradient is zero but for rounding, then
    trained apart), dropout on: the same losses and weights, bit for bit."""
    model, data = with_dropout(build(name))
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    expected = fit(reference, data, "auto", steps=4)
    strategy = SpillingStrategy()
    torch.manual_seed(0)
    whole = fit(model, data, strategy, steps=4)
    assert len(strategy.segment_memory) == 1
    assert whole.losses == expected.losses
    for (key, value), expected_value in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected_value), key


@pytest.mark.slow  # six real models, each fitted several times
def with_dropout(built: tuple[RealModel, Dataset], p: float = 0.1) -> tuple[RealModel, Dataset]:
    """The model of ``built`` with its dropout layers (those its library gives it) at ``p``, and its data."""
    model, data = built
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
    return model, data


def test_real_models_trained_together_each_as_if_alone():
    """MultiModelTrainer on the models the project did not write, two devices, their dropout on (BERT, GPT-2, ViT,
    ...): each model, seeded and built right before it is added as it would be before a fit alone, has the losses
    and weights of its plain single-device training."""
    budget = max(budget_for_two_or_more_shards(*build(name)) for name in MODELS)
    sweep = MultiModelTrainer(devices=2, memory_budget=budget, enable_progress_bar=False)
    records, models = {}, {}
    for name in MODELS:
        models[name], data = with_dropout(build(name))
        records[name] = RecordLosses()
        sweep.add(
            models[name],
            train_dataloaders=DataLoader(data, batch_size=BATCH),
            max_steps=STEPS,
            name=name,
            callbacks=[records[name]],
            logger=False,
            enable_checkpointing=False,
        )
    trainers = sweep.fit()
    assert [r.status for r in sweep.results] == ["finished"] * len(MODELS), [r.error for r in sweep.results]
    assert any(len(t.strategy.shards) >= 2 for t in trainers)  # type: ignore[attr-defined]
    assert sum(isinstance(m, nn.Dropout) for model in models.values() for m in model.modules()) >= 20
    for name in MODELS:
        reference, data = with_dropout(build(name))
        expected = fit(reference, data, "auto")
        torch.testing.assert_close(
            torch.tensor(records[name].losses), torch.tensor(expected.losses), rtol=1e-4, atol=1e-5, msg=name
        )
        assert_same_weights(models[name], reference, name)


def test_a_study_of_real_models_trains_each_trial_spilled_as_if_alone(tmp_path):
    """`optimize` on models the project did not write: an Optuna study whose trials choose among three Hugging Face
    models, spilled, two at once on two devices; the pruner stops every other trial at its first report. Each
    trial's losses, for the steps it ran, and each finished trial's weights equal plain single-device training."""
    optuna = pytest.importorskip("optuna")
    names = ["gpt2", "bert", "resnet"]
    budget = max(budget_for_two_or_more_shards(*build(name)) for name in names)
    trained: dict[int, tuple[str, L.LightningModule, RecordLosses]] = {}

    class PruneOddTrials(optuna.pruners.BasePruner):
        def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
            return trial.number % 2 == 1

    def trial_model(trial: optuna.trial.Trial) -> dict:
        name = names[trial.number % len(names)]
        model, data = build(name)
        trained[trial.number] = name, model, RecordLosses()
        loader = DataLoader(data, batch_size=BATCH)
        return dict(
            model=model, train_dataloaders=loader, val_dataloaders=loader, max_steps=4, val_check_interval=2,
            callbacks=[trained[trial.number][2]], logger=False, enable_checkpointing=False,
        )  # fmt: skip

    study = optuna.create_study(pruner=PruneOddTrials())
    sweep = MultiModelTrainer(devices=2, memory_budget=budget, checkpoint_dir=str(tmp_path), enable_progress_bar=False)
    outcomes = sweep.optimize(study, trial_model, n_trials=4, monitor="val_loss")
    assert [o.state for o in sorted(outcomes, key=lambda o: o.number)] == ["complete", "pruned"] * 2
    assert any(len(model.trainer.strategy.shards) >= 2 for _, model, _ in trained.values())  # spilled
    for number, (name, model, record) in trained.items():
        reference = build(name)[0]
        expected = fit(reference, build(name)[1], "auto", steps=len(record.losses))
        assert len(record.losses) == (2 if number % 2 else 4), name
        torch.testing.assert_close(
            torch.tensor(record.losses), torch.tensor(expected.losses), rtol=1e-4, atol=1e-5, msg=name
        )
        if number % 2 == 0:
            assert_same_weights(model, reference, name)
