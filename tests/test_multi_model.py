"""MultiModelTrainer trains each model of a sweep as if alone, its shards interleaved over the devices."""

from __future__ import annotations

import copy
import csv
import itertools
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import run_job
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from models import VOCAB, TinyLM, token_dataset
from spilled_runs import StepLosses
from spilled_runs import assert_same_model as assert_same_weights
from spilled_runs import losses as step_losses
from study_models import LossLog
from study_models import logged_losses as logged_step_losses
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_varuna import MultiModelTrainer, SpillingStrategy, demos
from lightning_varuna.multimodel import DeviceScheduler, SweepStopped
from lightning_varuna.multimodel import scheduler as scheduler_module
from lightning_varuna.multimodel.devices import staying_models
from lightning_varuna.multimodel.pruning import next_decision
from lightning_varuna.multimodel.scheduler import HOLD_S
from lightning_varuna.pipeline.replay import generator_states


class MLP(demos.MLP):
    """The demo MLP of ``depth`` tanh layers of ``width`` (regression with MSE), with an LR schedule under AdamW and a
    step that fails at step ``fail_at``."""

    def __init__(self, width: int, depth: int, optimizer: str = "adamw", lr: float = 1e-2, fail_at: int = -1) -> None:
        super().__init__(width, depth, optimizer=optimizer, lr=lr)
        self.fail_at = fail_at

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at:
            raise ValueError(f"bad batch at step {self.global_step}")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if self.optimizer_name == "sgd":
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


def regression_data(width: int, rows: int = 128) -> DataLoader:
    generator = torch.Generator().manual_seed(width)
    x, y = torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16)


QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def logged_losses(logger_dir: Path) -> list[float]:
    """The per-step ``train_loss`` a CSVLogger wrote."""
    with open(logger_dir / "metrics.csv") as rows:
        return [float(row["train_loss"]) for row in csv.DictReader(rows) if row.get("train_loss")]


def fit_alone(model: L.LightningModule, train: DataLoader, val: DataLoader | None = None, **kwargs: Any) -> L.Trainer:
    """Plain single-device Lightning training, on one thread as a sweep's CPU device computes (on more threads some
    CPUs sum in another order: 2e-6 apart after 6 clipped Adam steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[StepLosses()], **{**QUIET, **kwargs})
        trainer.fit(model, train, val)
    finally:
        torch.set_num_threads(threads)
    return trainer


def unlike_models() -> list[tuple[L.LightningModule, DataLoader, DataLoader | None, dict[str, Any]]]:
    """A sweep's models of different sizes, lengths and optimizers, each with its loaders and Trainer arguments: MLPs
    under AdamW with an LR schedule (validated) and under SGD, a token model with a tied head, gradient clipping and
    accumulation, and an MLP trained for 2 epochs."""
    torch.manual_seed(0)
    return [
        (MLP(48, 4), regression_data(48), regression_data(48, 32), {"max_steps": 9}),
        (MLP(96, 3, optimizer="sgd"), regression_data(96), None, {"max_steps": 5}),
        (
            TinyLM(),
            DataLoader(token_dataset(64), batch_size=8),
            None,
            {"max_steps": 6, "gradient_clip_val": 0.5, "accumulate_grad_batches": 2},
        ),
        (MLP(32, 2), regression_data(32), None, {"max_epochs": 2}),
    ]


def test_each_model_of_a_sweep_trains_as_if_alone():
    """Models of different sizes, lengths and optimizers (AdamW with an LR schedule, SGD with momentum; a token
    model with a tied head, gradient clipping and accumulation; validation) share two devices: each one's per-step
    losses, validation loss and final weights equal plain single-device training, and their shards were interleaved
    over both devices, never two at once on one device."""
    specs = unlike_models()
    references = [copy.deepcopy(model) for model, *_ in specs]
    sweep = MultiModelTrainer(devices=2, memory_budget="400KB", enable_progress_bar=False)
    sweep_losses = []
    for model, train, val, kwargs in specs:
        sweep_losses.append(StepLosses())
        sweep.add(
            model,
            train_dataloaders=train,
            val_dataloaders=val,
            callbacks=[sweep_losses[-1]],
            logger=False,
            enable_checkpointing=False,
            **kwargs,
        )
    trainers = sweep.fit()

    assert [r.status for r in sweep.results] == ["finished"] * 4
    assert [t.lightning_module for t in trainers] == [model for model, *_ in specs]
    assert any(len(t.strategy.shards) > 1 for t in trainers)  # type: ignore[attr-defined]
    for (model, train, val, kwargs), reference, losses, trainer in zip(specs, references, sweep_losses, trainers):
        alone = fit_alone(reference, train, val, **kwargs)
        torch.testing.assert_close(losses.losses, step_losses(alone), rtol=1e-5, atol=1e-6)
        assert_same_weights(model, reference)
        assert sweep.results[trainers.index(trainer)].steps == trainer.global_step == alone.global_step
        if val is not None:
            torch.testing.assert_close(trainer.callback_metrics["val_loss"], alone.callback_metrics["val_loss"])

    spans = sweep.spans
    for device in (0, 1):
        on_device = sorted((s for s in spans if s.device == device), key=lambda s: s.start_s)
        assert on_device, f"device {device} was never used"
        assert all(a.end_s <= b.start_s for a, b in zip(on_device, on_device[1:])), "two turns at once on a device"
    assert any(len({s.device for s in spans if s.model == r.name}) == 2 for r in sweep.results)
    assert any(
        a.model != b.model and a.device != b.device and a.start_s < b.end_s and b.start_s < a.end_s
        for a in spans
        for b in spans
    ), "no two models ever computed at the same time"


class PositionCodedMLP(MLP):
    """Adds a code it computes in its forward (as a sinusoidal position code is): a tensor of the default dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + torch.sin(torch.arange(x.shape[-1]) / 7.0))


def test_a_sweep_in_a_true_precision_trains_each_model_as_if_alone():
    """``precision="bf16-true"`` sets torch's default dtype (one per process) while a step runs: the models of one
    such sweep step in it together, each as when trained alone, and the default dtype is restored after (before,
    their steps' contexts crossed and left one another in float32, and bfloat16 after the sweep). A model of
    another precision is refused in that sweep."""
    torch.manual_seed(0)
    models = [PositionCodedMLP(32, 3), PositionCodedMLP(16, 2, optimizer="sgd"), PositionCodedMLP(32, 2)]
    references = [copy.deepcopy(model) for model in models]
    sweep = MultiModelTrainer(devices=2, memory_budget="32KB", enable_progress_bar=False)
    sweep_losses = [StepLosses() for _ in models]
    for model, losses in zip(models, sweep_losses):
        width = model.layers[0].in_features
        options = dict(max_steps=6, precision="bf16-true", **QUIET)
        sweep.add(model, train_dataloaders=regression_data(width), callbacks=[losses], **options)
    with pytest.raises(ValueError, match=r"`precision='32-true'` steps with .*float32, .*bfloat16"):
        sweep.add(MLP(16, 2), train_dataloaders=regression_data(16), max_steps=2, **QUIET)
    trainers = sweep.fit()

    assert torch.get_default_dtype() == torch.float32
    assert [r.status for r in sweep.results] == ["finished"] * 3
    assert any(len(t.strategy.shards) > 1 for t in trainers)  # type: ignore[attr-defined]
    for model, reference, losses in zip(models, references, sweep_losses):
        width = model.layers[0].in_features
        alone = fit_alone(reference, regression_data(width), max_steps=6, precision="bf16-true")
        torch.testing.assert_close(losses.losses, step_losses(alone), rtol=1e-5, atol=1e-6)
        assert_same_weights(model, reference)


def test_the_longest_remaining_model_gets_the_free_device():
    """LRTF: the waiting models are served in order of remaining time (remaining steps times measured device time
    per step; a model that has not stepped yet estimated from its size at the measured rate)."""
    scheduler = DeviceScheduler(devices=1)
    for name, size in (("short", 10), ("long", 10), ("unmeasured-big", 40), ("unmeasured-small", 1)):
        scheduler.add(name, size)
    scheduler.clock("short").device_s = scheduler.clock("long").device_s = 1.0  # 1 s per step over their first step
    scheduler.stepped("short", steps_done=1, total_steps=3, steps_before=0)  # 2 s left
    scheduler.stepped("long", steps_done=1, total_steps=9, steps_before=0)  # 8 s left
    scheduler.stepped("unmeasured-big", steps_done=0, total_steps=3, steps_before=0)  # 40 x 3 x 0.1 s = 12 s
    scheduler.stepped("unmeasured-small", steps_done=0, total_steps=5, steps_before=0)  # 1 x 5 x 0.1 s = 0.5 s
    served: list[str] = []

    def take_turn(name: str) -> None:
        with scheduler.turn(name, "forward", 0):
            served.append(name)

    with scheduler.turn("long", "step", 0):  # the device is busy while the others queue up
        threads = [
            threading.Thread(target=take_turn, args=(n,))
            for n in ("unmeasured-small", "short", "long", "unmeasured-big")
        ]
        for thread in threads:
            thread.start()
        while len(scheduler.queue()) < 4:
            time.sleep(0.01)
        assert scheduler.queue() == ["unmeasured-big", "long", "short", "unmeasured-small"]
    for thread in threads:
        thread.join()
    assert served == ["unmeasured-big", "long", "short", "unmeasured-small"]


def queue_of(scheduler: DeviceScheduler, names: list[str]) -> list[str]:
    """The order in which ``scheduler`` serves ``names``, all waiting while its one device is busy."""
    served: list[str] = []

    def take_turn(name: str) -> None:
        with scheduler.turn(name, "forward", 0):
            served.append(name)

    with scheduler.turn(names[0], "step", 0):
        threads = [threading.Thread(target=take_turn, args=(n,)) for n in names]
        for thread in threads:
            thread.start()
        while len(scheduler.queue()) < len(names):
            time.sleep(0.01)
        queue = scheduler.queue()
    for thread in threads:
        thread.join()
    assert served == queue
    return queue


@pytest.mark.parametrize("ranking", ["expected", "end"])
def test_a_trial_that_may_be_pruned_soon_counts_its_expected_remaining_time(ranking):
    """Ranked by "expected" remaining time, a model that a pruner decides on soon counts its time to that decision
    and, of the rest, the share of models that go on past it; ranked by "end", its whole remaining time. A model no
    pruner stops counts its remaining time either way."""
    scheduler = DeviceScheduler(devices=1, ranking=ranking)
    for name in ("near-rung", "far-rung", "unpruned"):
        scheduler.add(name, 10)
        scheduler.clock(name).device_s = 1.0  # 1 s per step over their first step
    # 100 steps left, its pruner decides at step 11 (10 steps from now); a third go on: 10 + 90 / 3 = 40 s expected.
    scheduler.stepped("near-rung", steps_done=1, total_steps=101, steps_before=0, decides_at=11, goes_on=1 / 3)
    # 80 steps left, its next rung at step 61: 60 + 20 / 3 = 66.7 s expected.
    scheduler.stepped("far-rung", steps_done=1, total_steps=81, steps_before=0, decides_at=61, goes_on=1 / 3)
    scheduler.stepped("unpruned", steps_done=1, total_steps=51, steps_before=0)  # 50 s left
    expected = scheduler.remaining_s(scheduler.clock("near-rung"))
    assert expected == pytest.approx(40.0 if ranking == "expected" else 100.0)
    if ranking == "expected":
        assert queue_of(scheduler, ["near-rung", "far-rung", "unpruned"]) == ["far-rung", "unpruned", "near-rung"]
    else:
        assert queue_of(scheduler, ["near-rung", "far-rung", "unpruned"]) == ["near-rung", "far-rung", "unpruned"]


def test_a_decision_after_a_model_s_end_does_not_count():
    scheduler = DeviceScheduler(devices=1, ranking="expected")
    scheduler.add("a", 10)
    scheduler.clock("a").device_s = 1.0
    scheduler.stepped("a", steps_done=1, total_steps=5, steps_before=0, decides_at=40, goes_on=0.25)
    assert scheduler.remaining_s(scheduler.clock("a")) == pytest.approx(4.0)


def test_when_a_pruner_decides_next():
    """The next decision is the first validation at or after the pruner's next deciding step (successive halving: its
    rungs; median and percentile: from the warm-up on, every interval), with the share of trials that go on."""
    optuna = pytest.importorskip("optuna")
    halving = optuna.pruners.SuccessiveHalvingPruner(min_resource=10, reduction_factor=3)
    # validations every 4 steps, the next at step 4: rung 10 -> validation at 12; rung 30 -> 32; rung 90 -> 92
    assert next_decision(halving, 0, 4, 4) == (12, pytest.approx(1 / 3))
    assert next_decision(halving, 12, 16, 4) == (32, pytest.approx(1 / 3))
    assert next_decision(halving, 40, 44, 4) == (92, pytest.approx(1 / 3))
    median = optuna.pruners.MedianPruner(n_warmup_steps=20, interval_steps=10)
    assert next_decision(median, 0, 5, 5) == (20, 0.5)
    assert next_decision(median, 20, 25, 5) == (30, 0.5)
    assert next_decision(optuna.pruners.PercentilePruner(25.0), 7, 8, 1) == (8, 0.25)
    assert next_decision(optuna.pruners.NopPruner(), 0, 4, 4) == (float("inf"), 1.0)
    assert next_decision(halving, 0, float("inf"), float("inf")) == (float("inf"), 1.0)  # no validation


class StoppedClock:
    """The scheduler's `time.perf_counter`: it stands still until the test moves it on."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_a_device_given_back_by_the_longest_model_is_held_for_it_briefly(monkeypatch):
    """Between two turns a model runs Lightning's code for a moment: the device it gave back waits for it (if it is
    among the D longest) while less than HOLD_S has passed, then goes to the next model. The scheduler's clock stands
    still here until the test moves it on: the order of the turns depends on the hold alone, not on how soon this
    test's threads run."""
    clock = StoppedClock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    scheduler = DeviceScheduler(devices=1)
    scheduler.add("long", 100)
    scheduler.add("short", 1)
    scheduler.stepped("long", steps_done=0, total_steps=10, steps_before=0)
    scheduler.stepped("short", steps_done=0, total_steps=10, steps_before=0)
    served: list[str] = []

    def take_turn() -> None:
        with scheduler.turn("short", "forward", 0):
            served.append("short")

    short = threading.Thread(target=take_turn, daemon=True)
    with scheduler.turn("long", "forward", 0):
        short.start()
        while scheduler.queue() != ["short"]:
            time.sleep(0.001)
    time.sleep(5 * HOLD_S)  # "long" comes back late in real time, but within the hold on the scheduler's clock
    assert served == [] and scheduler.queue() == ["short"]
    with scheduler.turn("long", "forward", 1):  # served before "short", which waits
        assert served == []
    assert scheduler.queue() == ["short"]  # the device is held for "long" again
    clock.now += 2 * HOLD_S  # "long" does not come back within the hold: "short" gets the device
    short.join(timeout=10)
    assert served == ["short"]
    assert [(span.model, span.shard) for span in scheduler.spans] == [("long", 0), ("long", 1), ("short", 0)]


def test_a_model_is_ranked_again_as_its_step_ends():
    """A model's remaining time drops by a step once the step's turns have taken more than half a step's device
    time, before Lightning reports the step: the device it gives back at the end of a step goes at once to a model
    that now has longer to go, instead of being held for it."""
    scheduler = DeviceScheduler(devices=1)
    for name in ("a", "b"):
        scheduler.add(name, 10)
        scheduler.clock(name).device_s = 0.02  # 20 ms per step over their first step
    scheduler.stepped("a", steps_done=1, total_steps=4, steps_before=0)  # 3 steps, 60 ms left
    scheduler.stepped("b", steps_done=1, total_steps=3.5, steps_before=0)  # 50 ms left
    a = scheduler.clock("a")
    a.device_s += 0.006  # a third of a step: still 3 steps left
    assert scheduler.remaining_s(a) == pytest.approx(0.06)
    a.device_s -= 0.006
    served: list[str] = []

    def take_turn(name: str) -> None:
        with scheduler.turn(name, "forward", 0):
            served.append(name)

    b = threading.Thread(target=take_turn, args=("b",))
    with scheduler.turn("a", "backward", 0):  # most of a step: a has 2 steps (40 ms) left when it gives the device back
        b.start()
        while scheduler.queue() != ["b"]:
            time.sleep(0.001)
        time.sleep(0.015)
    take_turn("a")  # back at once, but b goes first
    b.join()
    assert served == ["b", "a"]


class WhereItRuns(MLP):
    """Records the cores its thread may run on, in its forward (a turn) and in its training step (between turns)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, 2)
        self.in_forward: list[set[int]] = []
        self.in_step: list[set[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.in_forward.append(os.sched_getaffinity(0))
        return super().forward(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.in_step.append(os.sched_getaffinity(0))
        return super().training_step(batch, batch_idx)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="threads are pinned to cores on Linux")
def test_on_the_cpu_a_turn_runs_pinned_to_its_devices_core():
    """A device is a core: a shard's forward runs on its device's core alone; the model's thread stays pinned there
    between its turns (pinned again only for a turn on another device), and the thread that runs the sweep is not
    pinned."""
    cores = sorted(os.sched_getaffinity(0))
    devices = min(2, len(cores))
    models = [WhereItRuns(16), WhereItRuns(24)]
    sweep = MultiModelTrainer(devices=devices, enable_progress_bar=False)
    for model in models:
        sweep.add(model, train_dataloaders=regression_data(model.layers[0].in_features), max_steps=3, **QUIET)
    sweep.fit()
    pinned = [where for model in models for where in model.in_forward]
    assert len(pinned) >= 6 and all(len(where) == 1 and where <= set(cores[:devices]) for where in pinned)
    # The three training steps (set-up runs the first step, up to `self(...)`, inside its own turn).
    assert all(len(where) == 1 and where <= set(cores[:devices]) for model in models for where in model.in_step[-3:])
    assert os.sched_getaffinity(0) == set(cores)


def test_a_failing_model_ends_alone_with_its_checkpoints_intact(tmp_path):
    """An exception in one model's step ends that model's fit with its error; its last checkpoint resumes, and the
    resumed model goes on exactly as an uninterrupted run of it in plain single-device Lightning (the same per-step
    losses from the checkpoint on, the same final weights); the other model trains on exactly as alone."""
    torch.manual_seed(0)
    failing, healthy = MLP(32, 3, fail_at=4), MLP(48, 2)
    uninterrupted, reference = copy.deepcopy(failing), copy.deepcopy(healthy)
    uninterrupted.fail_at = -1
    # Cuts both (they need 67 KB and 91 KB whole): a model that stays on the device whole may use all the budget.
    sweep = MultiModelTrainer(devices=2, memory_budget="57KB", enable_progress_bar=False)
    failing_losses = StepLosses()
    sweep.add(
        failing,
        train_dataloaders=regression_data(32),
        max_steps=8,
        logger=False,
        name="failing",
        callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1), failing_losses],
    )
    sweep.add(
        healthy,
        train_dataloaders=regression_data(48),
        max_steps=8,
        logger=False,
        name="healthy",
        enable_checkpointing=False,
    )
    trainers = sweep.fit()

    failed, finished = sweep.results
    assert (failed.status, finished.status) == ("failed", "finished")
    assert isinstance(failed.error, ValueError) and "bad batch at step 4" in str(failed.error)
    assert trainers[0].global_step == 4
    assert len(trainers[0].strategy.shards) > 1  # type: ignore[attr-defined]
    fit_alone(reference, regression_data(48), max_steps=8)
    assert_same_weights(healthy, reference)

    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    expected = step_losses(fit_alone(uninterrupted, regression_data(32), max_steps=8))
    torch.testing.assert_close(failing_losses.losses, expected[:4], rtol=1e-5, atol=1e-6)
    resumed = MLP(32, 3)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=8, strategy=SpillingStrategy(), callbacks=[StepLosses()], **QUIET
    )
    trainer.fit(resumed, regression_data(32), ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert trainer.global_step == 8
    torch.testing.assert_close(step_losses(trainer), expected[4:], rtol=1e-5, atol=1e-6)
    assert_same_weights(resumed, uninterrupted)


def test_a_models_steps_count_the_step_whose_callback_failed():
    """A callback that fails at the end of a step fails the model after that step: its result counts it, as its
    Trainer's global step does."""

    class FailsAfterStep3(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("the callback failed")

    sweep = MultiModelTrainer(devices=1, enable_progress_bar=False)
    sweep.add(MLP(16, 2), train_dataloaders=regression_data(16), max_steps=6, callbacks=[FailsAfterStep3()], **QUIET)
    (trainer,) = sweep.fit()
    assert sweep.results[0].status == "failed"
    assert sweep.results[0].steps == trainer.global_step == 3


def test_sigterm_stops_every_model_at_a_shard_boundary_and_each_resumes(tmp_path):
    """SIGTERM during the sweep stops every model; each resumes from its last checkpoint, in a new sweep, and ends
    with the weights of an uninterrupted single-device run."""
    torch.manual_seed(0)
    models = [MLP(32, 3), MLP(48, 2, optimizer="sgd")]
    references = [copy.deepcopy(m) for m in models]

    class SigtermAtStep(L.Callback):
        """SIGTERM once this model has stepped 3 times and the other has checkpointed (on a busy machine the other
        may not have stepped yet at this one's step 3)."""

        sent = threading.Event()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            other_saved = (tmp_path / "m1").is_dir() and any((tmp_path / "m1").iterdir())
            if trainer.global_step >= 3 and other_saved and not self.sent.is_set():
                os.kill(os.getpid(), signal.SIGTERM)
                self.sent.set()

    class WaitsForTheSignal(L.Callback):
        """Holds the other model after its second step until the signal is sent (on a busy machine it could end
        all its steps before the first model's third)."""

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step >= 2:
                SigtermAtStep.sent.wait(timeout=60)

    def add_all(sweep: MultiModelTrainer, ckpt_paths: list[str | None]) -> None:
        for i, (model, ckpt_path) in enumerate(zip(models, ckpt_paths)):
            callbacks: list[L.Callback] = [ModelCheckpoint(tmp_path / f"m{i}", every_n_train_steps=1, save_top_k=-1)]
            if ckpt_path is None:
                callbacks.append(SigtermAtStep() if i == 0 else WaitsForTheSignal())
            sweep.add(
                model,
                train_dataloaders=regression_data(32 + 16 * i),
                max_steps=20,
                logger=False,
                callbacks=callbacks,
                ckpt_path=ckpt_path,
            )

    previous = signal.getsignal(signal.SIGTERM)
    sweep = MultiModelTrainer(devices=2, memory_budget="57KB", enable_progress_bar=False)  # cuts both models
    add_all(sweep, [None, None])
    sweep.fit()
    assert signal.getsignal(signal.SIGTERM) is previous, "the sweep's handler is removed afterwards"
    assert [r.status for r in sweep.results] == ["stopped", "stopped"]
    assert all(isinstance(r.error, SweepStopped) for r in sweep.results)
    last = [max((tmp_path / f"m{i}").iterdir(), key=lambda p: int(p.stem.split("step=")[1])) for i in range(2)]
    assert all(int(p.stem.split("step=")[1]) < 20 for p in last)

    models = [MLP(32, 3), MLP(48, 2, optimizer="sgd")]
    resumed = MultiModelTrainer(devices=2, memory_budget="57KB", enable_progress_bar=False)
    add_all(resumed, [str(p) for p in last])
    trainers = resumed.fit()
    assert [t.global_step for t in trainers] == [20, 20]
    for i, (model, reference) in enumerate(zip(models, references)):
        fit_alone(reference, regression_data(32 + 16 * i), max_steps=20)
        assert_same_weights(model, reference)


class InterruptedMLP(MLP):
    """Raises KeyboardInterrupt in its training step at step 2, or in its first validation step (Lightning's sanity
    check, while its model holds torch's generator)."""

    def __init__(self, width: int, depth: int, where: str) -> None:
        super().__init__(width, depth)
        self.where = where

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.where == "training_step" and self.global_step == 2:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        if self.where == "sanity check":
            raise KeyboardInterrupt
        super().validation_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["training_step", "sanity check"])
def test_a_keyboard_interrupt_in_a_models_step_stops_the_sweep_as_ctrl_c_does(where):
    """Each model stops, its weights back in the module (before, the interrupted model kept none: Lightning's handler
    raised in its thread before the teardown, and in the sanity check `fit` waited forever for the generator it
    held)."""
    torch.manual_seed(0)
    models = [InterruptedMLP(16, 2, where), MLP(16, 2)]
    models[1].layers.insert(1, nn.Dropout(0.2))  # draws random numbers: it needs the generator
    sweep = MultiModelTrainer(devices=2, enable_progress_bar=False)
    data = {"train_dataloaders": regression_data(16), "val_dataloaders": regression_data(16, 32)}
    # The other model could not finish before the interrupt, even on a busy machine.
    trainers = [sweep.add(model, **data, max_steps=steps, **QUIET) for model, steps in zip(models, (6, 10**6))]
    fitting = threading.Thread(target=sweep.fit, daemon=True)
    fitting.start()
    fitting.join(60)
    assert not fitting.is_alive(), "the sweep did not end"
    assert [r.status for r in sweep.results] == ["stopped", "stopped"]
    assert all(t.state.status == "interrupted" for t in trainers)
    assert [sum(p.numel() for p in model.parameters()) for model in models] == [2 * 272, 2 * 272]


_DRAWS: dict[int, list[tuple[int, torch.Tensor]]] = {}  # a model -> (its layer, a mask drawn), in order
_MODEL_IDS = itertools.count()


@torch.library.custom_op("test_multi_model::dropout_mask", mutates_args=())
def dropout_mask(like: torch.Tensor, p: float, model_id: int, layer: int) -> torch.Tensor:
    """A dropout mask for ``like``, drawn from torch's global generator as `nn.Dropout`'s is; logged under
    ``model_id``."""
    mask = torch.empty_like(like).bernoulli_(1 - p)
    _DRAWS[model_id].append((layer, mask.clone()))
    return mask


@dropout_mask.register_fake
def _(like: torch.Tensor, p: float, model_id: int, layer: int) -> torch.Tensor:
    return torch.empty_like(like)


class LoggedDropout(nn.Module):
    """Dropout whose every mask (a forward's, a recompute's) is logged, even when the model runs as a traced graph
    (the mask is an op of its own); with ``replay`` set, it takes its masks from there instead (plain Lightning
    training with the masks that a sweep drew)."""

    def __init__(self, p: float, model_id: int, layer: int) -> None:
        super().__init__()
        self.p, self.model_id, self.layer = p, model_id, layer
        self.replay: Iterator[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        if self.replay is not None:
            mask = next(self.replay)
        else:
            mask = torch.ops.test_multi_model.dropout_mask(x.detach(), self.p, self.model_id, self.layer)
        return x * mask / (1 - self.p)


class DrawnMasks(L.Callback):
    """Logs where each training step starts among its model's masks, and the batch the step trains on."""

    def __init__(self) -> None:
        self.model_id = next(_MODEL_IDS)
        _DRAWS[self.model_id] = []
        self.batches: list[list[torch.Tensor]] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _DRAWS[self.model_id].append((-1, torch.empty(0)))
        self.batches.append([t.clone() for t in batch])

    def forward_masks(self, layers: int) -> tuple[list[list[torch.Tensor]], int]:
        """Each layer's mask in each step: the step's first draw of it (its forward's), and how many later draws the
        steps made (the recomputes of shards that did not keep their activations), each of which must be the same
        mask as its forward's."""
        steps: list[dict[int, list[torch.Tensor]]] = []
        for layer, mask in _DRAWS.pop(self.model_id):
            if layer < 0:
                steps.append({})
            elif steps:  # before the first step: set-up's measuring runs
                steps[-1].setdefault(layer, []).append(mask)
        assert all(sorted(step) == list(range(layers)) for step in steps)
        for i, step in enumerate(steps):
            for layer, masks in step.items():
                replayed = all(torch.equal(mask, masks[0]) for mask in masks[1:])
                assert replayed, f"step {i}: a recompute of layer {layer} drew other masks than its forward"
        recomputes = sum(len(masks) - 1 for step in steps for masks in step.values())
        return [[step[layer][0] for step in steps] for layer in range(layers)], recomputes


def lm_with_logged_dropout(p: float, drawn: DrawnMasks) -> TinyLM:
    """TinyLM whose blocks' dropout masks are logged under ``drawn``."""
    model = TinyLM(dropout=p)
    for layer, block in enumerate(model.blocks):
        block.drop = LoggedDropout(p, drawn.model_id, layer)
    return model


def assert_trained_as_alone_with_its_masks(
    model: TinyLM, initial: TinyLM, drawn: DrawnMasks, losses: StepLosses, max_steps: int, recomputed: bool = True
) -> None:
    """``model``, trained from a copy of ``initial`` in a sweep, has the per-step losses and final weights of plain
    Lightning training of ``initial`` on the batches and with the dropout masks that its forwards drew in the sweep
    (each recompute, of which there were some if ``recomputed``, having drawn its forward's masks again)."""
    masks, recomputes = drawn.forward_masks(len(initial.blocks))
    assert (recomputes > 0) == recomputed
    for block, layer_masks in zip(initial.blocks, masks):
        block.drop.replay = iter(layer_masks)
    alone = fit_alone(initial, DataLoader(drawn.batches, batch_size=None), max_steps=max_steps)
    torch.testing.assert_close(losses.losses, step_losses(alone), rtol=1e-5, atol=1e-6)
    assert_same_weights(model, initial)


def test_dropout_models_share_the_generator_one_at_a_time():
    """Models with dropout take their forward and recompute turns one at a time on torch's global generator: each
    recompute draws its forward's masks again, and each model trains as plain Lightning does with the masks (and
    batches) that its forwards drew; a model without dropout runs beside them and trains exactly as alone."""
    torch.manual_seed(0)
    drawn = [DrawnMasks(), DrawnMasks()]
    dropout_models = [lm_with_logged_dropout(0.2, drawn[0]), lm_with_logged_dropout(0.1, drawn[1])]
    initial = [copy.deepcopy(model) for model in dropout_models]
    plain = MLP(32, 3)
    reference = copy.deepcopy(plain)
    sweep = MultiModelTrainer(devices=2, memory_budget="85KB", enable_progress_bar=False)
    losses = [StepLosses(), StepLosses()]
    for model, model_drawn, model_losses in zip(dropout_models, drawn, losses):
        sweep.add(
            model,
            train_dataloaders=DataLoader(token_dataset(64), batch_size=8, shuffle=True),
            max_steps=8,
            logger=False,
            enable_checkpointing=False,
            callbacks=[model_drawn, model_losses],
        )
    sweep.add(plain, train_dataloaders=regression_data(32), max_steps=8, logger=False, enable_checkpointing=False)
    trainers = sweep.fit()
    assert [r.status for r in sweep.results] == ["finished"] * 3, [r.error for r in sweep.results]
    names = [r.name for r in sweep.results]
    for name in names[:2]:
        assert any(sweep.scheduler.clock(name).draws.values())
    assert not any(sweep.scheduler.clock(names[2]).draws.values())
    for trainer, model, start, model_drawn, model_losses in zip(trainers, dropout_models, initial, drawn, losses):
        assert len(trainer.strategy.shards) > 1  # type: ignore[attr-defined]
        assert_trained_as_alone_with_its_masks(model, start, model_drawn, model_losses, max_steps=8)
    fit_alone(reference, regression_data(32), max_steps=8)
    assert_same_weights(plain, reference)


class SplitTokens(L.LightningDataModule):
    """Token data split into training and validation rows by `random_split` without a generator of its own: the
    split draws from torch's global generator in `setup`, as many datamodules' do."""

    def setup(self, stage: str) -> None:
        self.train, self.val = torch.utils.data.random_split(token_dataset(64), [48, 16])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=8)


class NoisyTokens(torch.utils.data.Dataset):
    """`token_dataset`'s rows with a tenth of their input tokens replaced by random ones, drawn from torch's global
    generator as each row is read (an augmentation)."""

    def __init__(self, seed: int) -> None:
        self.rows = token_dataset(64, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx, y = self.rows[i]
        noisy = torch.rand(idx.shape) < 0.1
        return torch.where(noisy, torch.randint_like(idx, VOCAB), idx), y


def dropout_lm(seed: int, blocks: int, p: float) -> TinyLM:
    """TinyLM with dropout, initialized from ``seed`` (which also seeds what it draws next, as before a fit)."""
    torch.manual_seed(seed)
    return TinyLM(blocks=blocks, dropout=p)


class RowsRead(L.Callback):
    """Writes the rows of each training batch to ``path``, by their first feature (their index in the dataset)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        with open(self.path, "a") as f:
            f.write("".join(f"{row}\n" for row in batch[0][:, 0].long().tolist()))


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_model_s_shuffled_data_follows_the_seed_it_was_added_with(processes, monkeypatch, tmp_path):
    """Two models added after `L.seed_everything(1)` and `(2)`, with shuffled DataLoaders: each reads its epoch in the
    permutation of its own seed (as it does alone), not in that of the seed set last."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # restored after the test: seed_everything sets it
    data = TensorDataset(torch.arange(16.0)[:, None].expand(16, 8).clone(), torch.zeros(16, 8))
    sweep = MultiModelTrainer(devices=2, processes=processes, enable_progress_bar=False)
    for seed in (1, 2):
        L.seed_everything(seed, verbose=False)
        loader = DataLoader(data, batch_size=4, shuffle=True)
        sweep.add(MLP(8, 2), train_dataloaders=loader, callbacks=[RowsRead(tmp_path / f"{seed}")], max_steps=4, **QUIET)
    sweep.fit()
    for seed in (1, 2):
        rows = [int(row) for row in (tmp_path / f"{seed}").read_text().split()]
        assert rows == list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed)), seed


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_models_with_dropout_train_as_alone_from_the_generator_state_they_were_added_in(processes, tmp_path):
    """Each model draws its random numbers (dropout masks, its datamodule's split, its DataLoader's seed, its
    dataset's augmentation) from a generator state of its own, starting where torch's generator was when the model
    was added: models seeded and built as they would be alone train exactly as alone (per-step losses, validation
    loss, weights), cut into shards that recompute their forwards or whole in one turn a step, beside each other on
    two devices, two of them validated on one DataLoader. The sweep's process draws from its own generator state
    meanwhile, as if no model had drawn. Worker processes start from a process that holds a torch.distributed
    process group, as an earlier VarunaStrategy or DDP run in it leaves one (forked, each model's metrics waited
    forever on that group's collectives)."""
    if processes and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    specs = [(1, 5, 0.2, SplitTokens()), (2, 2, 0.1, None), (3, 5, 0.3, None)]
    shared_val = DataLoader(token_dataset(16), batch_size=8)  # one loader for the validation of two models
    budget = {} if processes else {"memory_budget": "85KB"}
    sweep = MultiModelTrainer(devices=2, processes=processes, enable_progress_bar=False, **budget)
    logged = dict(log_every_n_steps=1, enable_checkpointing=False, max_epochs=2)
    models = []
    for i, (seed, blocks, p, datamodule) in enumerate(specs):
        models.append(dropout_lm(seed, blocks, p))  # as before a fit alone: seeded, built, then added
        loader = None if datamodule else DataLoader(NoisyTokens(seed), batch_size=8)
        logger = CSVLogger(tmp_path / "sweep", name=str(i), version=0)
        sweep.add(models[-1], datamodule, loader, None if datamodule else shared_val, logger=logger, **logged)
    torch.manual_seed(7)
    process_draws = torch.rand(3)
    torch.manual_seed(7)
    trainers = sweep.fit()
    assert [r.status for r in sweep.results] == ["finished"] * 3, [r.error for r in sweep.results]
    assert torch.equal(torch.rand(3), process_draws)
    if not processes:
        assert [len(t.strategy.shards) > 1 for t in trainers] == [True, False, True]  # type: ignore[attr-defined]
    for i, ((seed, blocks, p, datamodule), model, trainer) in enumerate(zip(specs, models, trainers)):
        alone = dropout_lm(seed, blocks, p)
        loader = None if datamodule else DataLoader(NoisyTokens(seed), batch_size=8)
        logger = CSVLogger(tmp_path / "alone", name=str(i), version=0)
        reference = L.Trainer(accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False, **logged)
        reference.fit(alone, loader, None if datamodule else shared_val, datamodule=datamodule and SplitTokens())
        losses = logged_losses(tmp_path / "sweep" / str(i) / "version_0")
        assert len(losses) == reference.global_step > 6  # two epochs
        torch.testing.assert_close(losses, logged_losses(Path(logger.log_dir)), rtol=1e-5, atol=1e-6)
        assert_same_weights(model, alone)
        torch.testing.assert_close(trainer.callback_metrics["val_loss"], reference.callback_metrics["val_loss"])


class StopWithACheckpoint(L.Callback):
    """Saves the model's checkpoint to ``path`` at the end of global step ``step`` and stops its fit there."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


@pytest.mark.slow  # two sweeps and the models alone
@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_model_with_dropout_resumed_from_its_checkpoint_continues_as_uninterrupted(processes, tmp_path):
    """A sweep's models with dropout stop with a checkpoint: mid-epoch before a validation (step 4); mid-epoch between
    validations (step 6), with a dataset that augments as it is read; at an epoch's end (step 8, by ModelCheckpoint
    as the epoch ends); in a validation mid-epoch (step 12, by ModelCheckpoint as it ends). A new sweep resumes each
    from its checkpoint, having drawn other numbers meanwhile: each model's losses, first run then resumed, are those
    of the model trained alone without a stop, and so are its weights."""
    specs = [(1, 5, 0.2, 4), (2, 2, 0.1, 6), (3, 5, 0.3, 8), (4, 2, 0.2, 12)]
    fitted = dict(max_steps=24, val_check_interval=4, **QUIET)

    def loaders(seed: int) -> dict[str, DataLoader]:
        train = NoisyTokens(seed) if seed == 2 else token_dataset(64, seed)
        val = DataLoader(token_dataset(16, seed), batch_size=8)
        return dict(train_dataloaders=DataLoader(train, batch_size=8), val_dataloaders=val)

    def stopping(i: int, step: int) -> dict[str, Any]:
        """What makes model ``i`` stop at ``step`` with its checkpoint ``last.ckpt``."""
        if step < 8:
            return dict(fitted, callbacks=[StopWithACheckpoint(tmp_path / str(i) / "last.ckpt", step)])
        checkpoints = ModelCheckpoint(tmp_path / str(i), save_last=True, save_on_train_epoch_end=step == 8)
        return dict(fitted, callbacks=[checkpoints], enable_checkpointing=True, max_steps=step)

    budget = {} if processes else {"memory_budget": "85KB"}
    first, second = (
        MultiModelTrainer(devices=2, processes=processes, enable_progress_bar=False, **budget) for _ in ".."
    )
    logs = [tmp_path / "losses" / f"{i}.jsonl" for i in range(len(specs))]  # written in worker processes too
    for i, (seed, blocks, p, step) in enumerate(specs):
        kwargs = stopping(i, step)
        kwargs["callbacks"].append(LossLog(logs[i]))
        first.add(dropout_lm(seed, blocks, p), **loaders(seed), **kwargs)
    first.fit()
    assert [r.status for r in first.results] == ["finished"] * 4, [r.error for r in first.results]
    assert [len(logged_step_losses(log)) for log in logs] == [step for *_, step in specs]
    models = []
    for i, (seed, blocks, p, _) in enumerate(specs):
        torch.manual_seed(100 + i)  # another state than the first run's at the checkpoint
        models.append(dropout_lm(seed, blocks, p))
        ckpt = str(tmp_path / str(i) / "last.ckpt")
        second.add(models[-1], **loaders(seed), callbacks=[LossLog(logs[i])], ckpt_path=ckpt, **fitted)
    second.fit()
    assert [r.status for r in second.results] == ["finished"] * 4, [r.error for r in second.results]
    for i, (seed, blocks, p, _) in enumerate(specs):
        alone, alone_losses = dropout_lm(seed, blocks, p), StepLosses()
        L.Trainer(accelerator="cpu", devices=1, callbacks=[alone_losses], **fitted).fit(alone, **loaders(seed))
        resumed = list(logged_step_losses(logs[i]).values())
        torch.testing.assert_close(resumed, alone_losses.losses, rtol=1e-5, atol=1e-6, msg=f"model {i}")
        assert_same_weights(models[i], alone)


def test_models_that_stay_on_the_cpu_take_one_turn_a_step_each_as_if_alone():
    """On the CPU without a spill folder a model that fits in one shard stays in host memory (spilling it there would
    free nothing) and takes each optimizer step, training step, backward and optimizer, in one turn: each model still
    trains exactly as alone (AdamW with an LR schedule and validation, SGD, gradient clipping and accumulation, whose
    batches that do not step take a forward and a backward turn, dropout on torch's global generator)."""
    torch.manual_seed(0)
    drawn = DrawnMasks()
    dropout_model = lm_with_logged_dropout(0.2, drawn)
    dropout_initial = copy.deepcopy(dropout_model)
    accumulated = {"max_steps": 6, "gradient_clip_val": 0.5, "accumulate_grad_batches": 2}
    specs: list[tuple[L.LightningModule, DataLoader, DataLoader | None, dict[str, Any]]] = [
        (MLP(40, 3), regression_data(40), regression_data(40, 32), {"max_steps": 9}),
        (MLP(64, 2, optimizer="sgd"), regression_data(64), None, {"max_steps": 5}),
        (TinyLM(), DataLoader(token_dataset(64), batch_size=8), None, accumulated),
    ]
    references = [copy.deepcopy(model) for model, *_ in specs]
    sweep = MultiModelTrainer(devices=2, enable_progress_bar=False)
    sweep_losses = [StepLosses() for _ in specs]
    for (model, train, val, kwargs), losses in zip(specs, sweep_losses):
        sweep.add(model, train_dataloaders=train, val_dataloaders=val, callbacks=[losses], **{**QUIET, **kwargs})
    dropout_losses = StepLosses()
    sweep.add(
        dropout_model,
        train_dataloaders=DataLoader(token_dataset(64), batch_size=8, shuffle=True),
        callbacks=[drawn, dropout_losses],
        max_steps=6,
        **QUIET,
    )
    trainers = sweep.fit()

    assert [r.status for r in sweep.results] == ["finished"] * 4, [r.error for r in sweep.results]
    assert [len(t.strategy.shards) for t in trainers] == [1] * 4  # type: ignore[attr-defined]
    for (model, train, val, kwargs), reference, losses, trainer in zip(specs, references, sweep_losses, trainers):
        alone = fit_alone(reference, train, val, **kwargs)
        torch.testing.assert_close(losses.losses, step_losses(alone), rtol=1e-5, atol=1e-6)
        assert_same_weights(model, reference)
        if val is not None:
            torch.testing.assert_close(trainer.callback_metrics["val_loss"], alone.callback_metrics["val_loss"])
    assert_trained_as_alone_with_its_masks(dropout_model, dropout_initial, drawn, dropout_losses, 6, recomputed=False)
    names = [r.name for r in sweep.results]
    turns = [[s.work for s in sweep.spans if s.model == name and s.work != "set-up"] for name in names]
    assert turns[0].count("step") == 9 and turns[1] == ["step"] * 5
    assert turns[2].count("step") == 6 and turns[2].count("forward") == turns[2].count("backward") == 6
    assert turns[3] == ["step"] * 6 and any(sweep.scheduler.clock(names[3]).draws.values())


def test_a_model_holding_the_generator_keeps_other_models_drawing_turns_out():
    """`hold_generator` (Lightning's sanity check, which restores the generator's state when it ends) lets the
    holder's own turns run, and keeps every other model's drawing turn waiting until `release_generator`."""
    scheduler = DeviceScheduler(devices=2)
    for name in ("holder", "other"):
        scheduler.add(name, 10)
    served: list[str] = []

    def drawing_turn(name: str) -> None:
        with scheduler.turn(name, "forward", 0, training=True) as holds_generator:  # draws unknown: needs it
            served.append(f"{name} holds={holds_generator}")

    scheduler.hold_generator("holder")
    other = threading.Thread(target=drawing_turn, args=("other",))
    other.start()
    while scheduler.queue() != ["other"]:
        time.sleep(0.001)
    drawing_turn("holder")
    time.sleep(5 * HOLD_S)
    assert served == ["holder holds=True"]
    scheduler.release_generator("holder")
    other.join(timeout=100 * HOLD_S)
    assert served == ["holder holds=True", "other holds=True"]


def test_building_a_model_waits_for_a_hold_of_the_generator_and_keeps_drawing_turns_out():
    """The sweep's own thread building a model (a study's trial: seeded initialization) holds the generator: it
    waits while a model holds it (Lightning's sanity check, which restores its state when it ends), and a model's
    drawing turn waits while the build runs."""
    scheduler = DeviceScheduler(devices=2)
    scheduler.add("setting-up", 10)
    served: list[str] = []
    build_may_end = threading.Event()

    def build() -> None:
        with scheduler.generator_held("building"):
            served.append("build")
            build_may_end.wait()

    def drawing_turn() -> None:
        with scheduler.turn("setting-up", "forward", 0, generator=True):
            served.append("turn")

    scheduler.hold_generator("setting-up")
    builder = threading.Thread(target=build)
    builder.start()
    time.sleep(5 * HOLD_S)
    assert served == []  # the build waits for the hold
    scheduler.release_generator("setting-up")
    while served != ["build"]:
        time.sleep(0.001)
    turn = threading.Thread(target=drawing_turn)
    turn.start()
    time.sleep(5 * HOLD_S)
    assert served == ["build"]  # the drawing turn waits for the build
    build_may_end.set()
    for thread in (builder, turn):
        thread.join(timeout=100 * HOLD_S)
    assert served == ["build", "turn"]


def test_a_build_waiting_for_the_generator_when_the_sweep_stops_runs_on():
    """A build that waits for the generator when the sweep is stopped (a second Ctrl-C) still runs: its trial is
    then stopped at its first turn and handed over like the others, not failed by the stop."""
    scheduler = DeviceScheduler(devices=1)
    scheduler.add("setting-up", 10)
    scheduler.hold_generator("setting-up")
    built = threading.Event()

    def build() -> None:
        with scheduler.generator_held("building"):
            built.set()

    builder = threading.Thread(target=build)
    builder.start()
    time.sleep(5 * HOLD_S)
    assert not built.is_set()
    scheduler.stop("KeyboardInterrupt")
    builder.join(timeout=100 * HOLD_S)
    assert built.is_set()


def test_a_models_generator_state_is_read_without_waiting_for_the_generator():
    """What a model draws from next, as its checkpoint is taken: its own state, read at once while another model
    holds the generator (and draws from it), and the generator's own while the model holds it."""
    scheduler = DeviceScheduler(devices=1)
    torch.manual_seed(1)
    own = generator_states(torch.device("cpu"))
    scheduler.add("saving", 10, own)
    scheduler.add("drawing", 10, generator_states(torch.device("cpu")))
    scheduler.hold_generator("drawing")
    torch.rand(5)  # the drawing model's draws move the generator, not the saving model's state
    assert torch.equal(scheduler.random_state("saving")[0], own[0])
    scheduler.release_generator("drawing")
    with scheduler.generator_held("saving"):
        torch.rand(3)
        assert torch.equal(scheduler.random_state("saving")[0], torch.get_rng_state())
    assert not torch.equal(scheduler.random_state("saving")[0], own[0])


def test_a_hold_of_the_generator_is_served_before_a_longer_models_set_up():
    """A model just set up holds the generator until its training starts; it gets it before the next set-up (which
    would hold it for much longer), even when the model being set up has the longer remaining time."""
    scheduler = DeviceScheduler(devices=2)
    for name, size in (("drawing", 1), ("setting-up", 1000), ("set-up", 1)):
        scheduler.add(name, size)
    drawing_started, drawing_may_end = threading.Event(), threading.Event()
    served: list[str] = []

    def drawing() -> None:
        with scheduler.turn("drawing", "forward", 0, generator=True):
            drawing_started.set()
            drawing_may_end.wait()

    def setting_up() -> None:
        with scheduler.turn("setting-up", "set-up", -1, generator=True):
            served.append("setting-up")

    def holding() -> None:
        scheduler.hold_generator("set-up")
        served.append("set-up")

    threads = [threading.Thread(target=f) for f in (drawing, setting_up, holding)]
    threads[0].start()
    drawing_started.wait()
    for thread in threads[1:]:
        thread.start()
    while len(scheduler.queue()) < 2:
        time.sleep(0.001)
    drawing_may_end.set()
    threads[2].join(timeout=100 * HOLD_S)
    assert served == ["set-up"] and scheduler.queue() == ["setting-up"]
    scheduler.release_generator("set-up")
    threads[1].join(timeout=100 * HOLD_S)
    assert served == ["set-up", "setting-up"]


def test_a_model_runs_alone_once_other_turns_end_and_no_turn_starts_meanwhile():
    """`alone` (a model tracing its forward) waits for the turn another model has under way, and keeps every other
    model's next turn waiting until it ends; the caller's own turn goes on."""
    scheduler = DeviceScheduler(devices=2)
    for name in ("tracing", "running", "next"):
        scheduler.add(name, 10)
    events: list[str] = []
    running_started, running_may_end, tracing_may_end = threading.Event(), threading.Event(), threading.Event()

    def running() -> None:
        with scheduler.turn("running", "forward", 0):
            running_started.set()
            running_may_end.wait()
            events.append("running's turn ends")

    def tracing() -> None:
        with scheduler.turn("tracing", "set-up", -1), scheduler.alone("tracing"):
            events.append("tracing alone")
            tracing_may_end.wait()
            events.append("tracing ends")

    def next_turn() -> None:
        with scheduler.turn("next", "forward", 0):
            events.append("next's turn")

    threads = [threading.Thread(target=running), threading.Thread(target=tracing)]
    threads[0].start()
    running_started.wait()
    threads[1].start()
    time.sleep(5 * HOLD_S)
    assert events == []  # waits for the turn under way
    running_may_end.set()
    while "tracing alone" not in events:
        time.sleep(0.001)
    threads.append(threading.Thread(target=next_turn))
    threads[-1].start()
    time.sleep(5 * HOLD_S)
    assert events == ["running's turn ends", "tracing alone"]  # a device is free, but no turn starts
    tracing_may_end.set()
    for thread in threads:
        thread.join(timeout=100 * HOLD_S)
    assert events == ["running's turn ends", "tracing alone", "tracing ends", "next's turn"]


class StepRecordingMLP(MLP):
    """Records, at each optimizer step, whether torch says it is compiling (which changes how the step computes)."""

    compiling_at_steps: list[bool] = []

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        optimizer.register_step_pre_hook(lambda *_: self.compiling_at_steps.append(torch.compiler.is_compiling()))
        return optimizer


def test_no_model_steps_while_another_traces():
    """torch.export marks the whole process as compiling while it traces a model (at set-up, and for the validation
    batches' shapes), and optimizers then compute their step by another code path, which rounds differently: no
    model of a sweep computes meanwhile (5 to 13 of 66 steps did before)."""
    StepRecordingMLP.compiling_at_steps.clear()
    sweep = MultiModelTrainer(devices=2, memory_budget="400KB", enable_progress_bar=False)
    for width in (48, 96, 32, 64, 80, 40):
        sweep.add(
            StepRecordingMLP(width, 3),
            train_dataloaders=regression_data(width, 80),
            val_dataloaders=regression_data(width, 24),
            max_steps=6,
            **QUIET,
        )
    sweep.fit()
    assert [r.status for r in sweep.results] == ["finished"] * 6
    assert len(StepRecordingMLP.compiling_at_steps) >= 36
    assert not any(StepRecordingMLP.compiling_at_steps)


def test_models_with_dropout_and_a_sanity_check_all_finish():
    """Each model's Lightning sanity check ends by restoring torch's generator, outside any turn: it must never land
    in another model's forward, or that model's recompute could not replay its dropout masks (it failed most sweeps
    of four such models before). Each model trains as plain Lightning does with the masks (and batches) that its
    forwards drew, each recompute drawing its forward's masks again."""
    torch.manual_seed(0)
    sweep = MultiModelTrainer(devices=2, memory_budget="85KB", enable_progress_bar=False)
    drawn = [DrawnMasks() for _ in range(4)]
    models = [lm_with_logged_dropout(0.2, model_drawn) for model_drawn in drawn]
    initial = [copy.deepcopy(model) for model in models]
    losses = [StepLosses() for _ in models]
    for i, (model, model_drawn, model_losses) in enumerate(zip(models, drawn, losses)):
        sweep.add(
            model,
            train_dataloaders=DataLoader(token_dataset(64, seed=i), batch_size=8, shuffle=True),
            val_dataloaders=DataLoader(token_dataset(16, seed=9), batch_size=8),
            max_steps=6,
            callbacks=[model_drawn, model_losses],
            **QUIET,
        )
    sweep.fit()
    assert [r.status for r in sweep.results] == ["finished"] * 4, [r.error for r in sweep.results]
    for model, start, model_drawn, model_losses in zip(models, initial, drawn, losses):
        assert_trained_as_alone_with_its_masks(model, start, model_drawn, model_losses, max_steps=6)


class DrawsKnownAtTrainStart(L.Callback):
    """What the scheduler knows, when training starts, of whether the model's forward draws random numbers."""

    def __init__(self, sweep: MultiModelTrainer, name: str) -> None:
        self.sweep, self.name = sweep, name
        self.draws: dict[tuple[int, bool], bool] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draws = dict(self.sweep.scheduler.clock(self.name).draws)


def test_set_up_finds_out_which_models_draw_no_random_numbers():
    """Set-up measures each model holding the generator: a model whose forward draws nothing needs the generator
    for none of its turns, not even its first, so it can train while other models are being set up; a model with
    dropout is left to its first forward, run holding the generator."""
    torch.manual_seed(0)
    sweep = MultiModelTrainer(devices=2, memory_budget="60KB", enable_progress_bar=False)  # cuts both (67 KB whole)
    known = {name: DrawsKnownAtTrainStart(sweep, name) for name in ("dropout", "plain")}
    sweep.add(
        TinyLM(dropout=0.2),
        train_dataloaders=DataLoader(token_dataset(32), batch_size=8),
        max_steps=2,
        name="dropout",
        callbacks=[known["dropout"]],
        **QUIET,
    )
    plain = MLP(32, 3)
    sweep.add(
        plain, train_dataloaders=regression_data(32), max_steps=2, name="plain", callbacks=[known["plain"]], **QUIET
    )
    sweep.fit()
    assert [r.status for r in sweep.results] == ["finished"] * 2, [r.error for r in sweep.results]
    plain_shards = len(sweep.results[1].trainer.strategy.shards)
    assert plain_shards > 1
    assert known["plain"].draws == {(shard, True): False for shard in range(plain_shards)}
    assert known["dropout"].draws == {}
    assert any(sweep.scheduler.clock("dropout").draws.values())


def test_progress_summary_and_trace(tmp_path, capsys):
    """One progress bar per model, counting optimizer steps, a summary table at the end, the device timeline as a
    Perfetto trace; fewer models than devices is said in one line."""
    torch.manual_seed(0)
    sweep = MultiModelTrainer(devices=3, memory_budget="100KB")
    sweep.add(MLP(32, 2), train_dataloaders=regression_data(32), max_steps=3, logger=False, name="small")
    large = sweep.add(
        MLP(48, 3),
        train_dataloaders=regression_data(48),
        max_steps=4,
        accumulate_grad_batches=2,
        logger=False,
        name="large",
    )
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(handler)
    try:
        sweep.fit()
    finally:
        lightning_log.removeHandler(handler)
    assert any("2 model(s) for 3 devices; 1 device(s) will stay idle" in line for line in lines)
    table = next(line for line in lines if line.startswith("MultiModelTrainer summary:")).splitlines()[1:]
    assert table[0].split() == ["model", "status", "steps", "final", "loss", "time", "(s)", "device", "share"]
    assert table[2].split()[:3] == ["small", "finished", "3"] and table[3].split()[:3] == ["large", "finished", "4"]
    shown = capsys.readouterr().err
    assert "small: 100%" in shown and "3/3" in shown and "large: 100%" in shown and "4/4" in shown
    counts = [(int(n), int(total)) for n, total in re.findall(r"large: [^|\r\n]*\|[^|]*\| (\d+)/(\d+)", shown)]
    assert counts and all(n <= total == 4 for n, total in counts)  # 8 batches, accumulated into 4 steps
    assert not re.search(r"large: +[1-9]\d*step", shown)  # a count past the total, which tqdm shows without it
    # The loss of the last batch, not what its backward ran on (divided by `accumulate_grad_batches`).
    assert sweep.results[1].final_loss == pytest.approx(float(large.callback_metrics["train_loss"]))

    sweep.write_trace(tmp_path / "sweep.json")
    trace = json.loads((tmp_path / "sweep.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in slices} == {"small", "large"}
    assert {e["args"]["work"] for e in slices} >= {"forward", "backward", "set-up"}
    assert len(slices) == len(sweep.spans)
    assert sweep.gpu_spans == []  # on GPUs, a second row per device


WARNING_IN_A_SWEEP = """
import warnings, sys
sys.path.insert(0, {tests!r})
from test_multi_model import MLP, regression_data
from lightning_varuna import MultiModelTrainer

class WarnsInItsStep(MLP):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            warnings.warn("the loss looks odd")
        return super().training_step(batch, batch_idx)

sweep = MultiModelTrainer(devices={devices}, processes={processes})
sweep.add(WarnsInItsStep(16, 2), train_dataloaders=regression_data(16), max_steps=4, logger=False, name="warns")
sweep.add(MLP(16, 2), train_dataloaders=regression_data(16), max_steps=4, logger=False, name="quiet")
sweep.fit()
"""


@pytest.mark.slow  # a Python process of its own
@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_warning_prints_above_the_bars_not_into_them(tmp_path, processes):
    """A Python warning from a model's step is printed on a line of its own, above the bars (as Lightning's log lines
    are), not appended to the text of a bar, also from a worker process (which sends it to the sweep's process).
    (In a process of its own: pytest records the warnings of its tests.)"""
    script = WARNING_IN_A_SWEEP.format(
        tests=os.path.dirname(__file__), devices=2 if processes else 1, processes=processes
    )
    proc = run_job(["-c", script], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", proc.stderr)  # the cursor moves of the bars
    at = shown.index("UserWarning: the loss looks odd")
    line_start = max(shown.rfind("\n", 0, at), shown.rfind("\r", 0, at)) + 1
    assert shown[line_start:at].startswith("<string>:"), repr(shown[line_start - 80 : at])  # no bar before it
    started = re.search(r"warns: [^\r\n]*/4", shown).start()  # its bar drawn once it knows its steps
    assert not re.search(r"warns: 0step", shown[started:]), shown[started:]  # never drawn as it was before that


class StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.global_step >= self.step


def test_a_bar_says_when_a_callback_stopped_its_model_early(capsys):
    sweep = MultiModelTrainer(devices=1)
    data = regression_data(8)
    sweep.add(MLP(8, 2), train_dataloaders=data, max_steps=6, callbacks=[StopAt(2)], logger=False, name="early")
    sweep.add(MLP(8, 2), train_dataloaders=data, max_steps=3, logger=False, name="full")
    sweep.fit()
    shown = capsys.readouterr().err
    assert re.search(r"early: [^\r\n]*2/6[^\r\n]*stopped early", shown)
    assert re.search(r"full +: 100%", shown) and not re.search(r"full +: [^\r\n]*stopped early", shown)
    assert [r.status for r in sweep.results] == ["finished", "finished"]


class SpillFiles(L.Callback):
    """Whether the spill tier under ``folder`` holds any file after each training batch."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen = folder, []

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(any(self.folder.rglob("*.bin")))


@pytest.mark.parametrize("keep_on_device", [None, True])
def test_models_leave_the_device_after_their_turns_unless_kept_there(tmp_path, keep_on_device):
    """Under the default budget every model is one shard; with a spill folder each one's shard goes to the disk after
    its turns, unless the sweep keeps the models on the device (by default only on a GPU, when all fit there)."""
    torch.manual_seed(0)
    models = [MLP(32, 3), MLP(48, 2)]
    references = [copy.deepcopy(m) for m in models]
    sweep = MultiModelTrainer(devices=2, spill_dir=tmp_path, keep_on_device=keep_on_device, enable_progress_bar=False)
    files = [SpillFiles(tmp_path / f"model{i}") for i in range(2)]
    for model, seen in zip(models, files):
        sweep.add(
            model,
            train_dataloaders=regression_data(model.layers[0].in_features),
            max_steps=4,
            callbacks=[seen],
            **QUIET,
        )
    trainers = sweep.fit()
    assert [len(t.strategy.shards) for t in trainers] == [1, 1]  # type: ignore[attr-defined]
    assert [seen.seen for seen in files] == [[keep_on_device is None] * 4] * 2
    for model, reference in zip(models, references):
        fit_alone(reference, regression_data(reference.layers[0].in_features), max_steps=4)
        assert_same_weights(model, reference)


def test_the_models_that_stay_on_a_gpu_are_those_that_save_the_most_copies():
    """Longest first (each step copies a model out and back), the larger first among equals, while they fit."""
    forever = float("inf")
    assert staying_models([1, 2, 3, 5], [10, 10, 10, 10], 7) == [False, True, False, True]  # 7 bytes, not 1+2+3
    assert staying_models([4, 3, 2, 1], [10, 20, 30, 40], 7) == [False, True, True, True]
    assert staying_models([4, 5, 2, 1], [forever, 100, 100, forever], 7) == [True, False, True, True]
    assert staying_models([8, 1], [50, 10], 7) == [False, True]
    assert staying_models([3, 3, 3], [10, 10, 10], 7) == [True, True, False]  # in the order added among equals
    assert staying_models([], [], 7) == []


def test_bad_input_fails_early():
    with pytest.raises(ValueError, match="runs on 'cpu' or 'gpu'"):
        MultiModelTrainer(accelerator="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            MultiModelTrainer(accelerator="gpu")
    elif torch.cuda.device_count() >= 2:
        with pytest.raises(NotImplementedError, match="one sweep per GPU"):
            MultiModelTrainer(accelerator="gpu", devices=2)
    sweep = MultiModelTrainer(devices=2)
    with pytest.raises(ValueError, match="Set `accelerator`, `devices` and the strategy's `memory_budget` on Multi"):
        sweep.add(MLP(8, 2), devices=2)
    with pytest.raises(ValueError, match=r"\['strategy'\] are the sweep's: .* under its `SpillingStrategy`"):
        sweep.add(MLP(8, 2), strategy="ddp")
    model = MLP(8, 2)
    sweep.add(model, name="a")
    with pytest.raises(ValueError, match="named 'a' is in the sweep already"):
        sweep.add(MLP(8, 2), name="a")
    with pytest.raises(ValueError, match="This `MLP` instance is in the sweep already"):
        sweep.add(model, name="b")
    with pytest.raises(TypeError, match=r"second argument is the datamodule, and got a DataLoader.*train_dataloaders="):
        sweep.add(MLP(8, 2), DataLoader(TensorDataset(torch.zeros(4, 8)), batch_size=2))  # as `Trainer.fit` takes it
    with pytest.raises(ValueError, match="No model to fit"):
        MultiModelTrainer().fit()


def test_a_sweep_is_fitted_once():
    sweep = MultiModelTrainer(devices=1, enable_progress_bar=False)
    sweep.add(MLP(8, 2), train_dataloaders=regression_data(8), max_steps=1, **QUIET)
    sweep.fit()
    with pytest.raises(RuntimeError, match="`fit` runs once"):
        sweep.fit()


def test_default_loggers_get_one_version_each(tmp_path):
    sweep = MultiModelTrainer(devices=2, enable_progress_bar=False)
    trainers = [sweep.add(MLP(8, 2), default_root_dir=tmp_path, max_steps=1) for _ in range(3)]
    assert len({t.logger.log_dir for t in trainers}) == 3  # type: ignore[union-attr]
    assert all(Path(t.logger.log_dir).is_dir() for t in trainers)  # type: ignore[union-attr, arg-type]
