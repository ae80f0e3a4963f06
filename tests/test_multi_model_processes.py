"""MultiModelTrainer(processes=True): each model trained whole in a worker process, as if alone, and what its fit
left (weights, progress, metrics, checkpoint paths) back in this process."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from spilled_runs import assert_same_model as assert_same_weights
from test_multi_model import MLP, fit_alone, logged_losses, regression_data, unlike_models

from lightning_varuna import MultiModelTrainer, SpillingStrategy
from lightning_varuna.multimodel import SweepStopped


def test_each_model_in_a_worker_process_trains_as_if_alone(tmp_path):
    """Models of different sizes, lengths and optimizers (a token model with a tied head, clipping and
    accumulation; validation; epochs) trained whole in two worker processes: each one's logged per-step losses and
    final weights equal plain single-device training, and its Trainer here holds its progress, metrics and best
    checkpoint; the longest ran first, the two devices at once."""
    specs = unlike_models()
    specs[0][3]["val_check_interval"] = 4
    references = [copy.deepcopy(model) for model, *_ in specs]
    sweep = MultiModelTrainer(devices=2, enable_progress_bar=False, processes=True)
    for i, (model, train, val, kwargs) in enumerate(specs):
        checkpoint = ModelCheckpoint(tmp_path / f"ckpt{i}", monitor="train_loss", save_top_k=1, every_n_train_steps=1)
        logger = CSVLogger(tmp_path, name=f"m{i}", version=0)
        sweep.add(
            model, train_dataloaders=train, val_dataloaders=val, callbacks=[checkpoint], logger=logger,
            log_every_n_steps=1, **kwargs,
        )  # fmt: skip
    trainers = sweep.fit()

    assert [r.status for r in sweep.results] == ["finished"] * 4
    for i, ((model, train, val, kwargs), reference, trainer) in enumerate(zip(specs, references, trainers)):
        alone_logger = CSVLogger(tmp_path / "alone", name=f"m{i}", version=0)
        alone = fit_alone(reference, train, val, log_every_n_steps=1, logger=alone_logger, **kwargs)
        logged = logged_losses(tmp_path / f"m{i}" / "version_0")
        assert len(logged) == alone.global_step
        torch.testing.assert_close(logged, logged_losses(Path(alone_logger.log_dir)), rtol=1e-5, atol=1e-6)
        assert_same_weights(model, reference)
        assert sweep.results[i].steps == trainer.global_step == alone.global_step
        assert trainer.current_epoch == alone.current_epoch and trainer.state.finished
        assert sweep.results[i].final_loss == pytest.approx(logged[-1], rel=1e-5)
        torch.testing.assert_close(trainer.callback_metrics["train_loss"], alone.callback_metrics["train_loss"])
        if val is not None:
            torch.testing.assert_close(trainer.callback_metrics["val_loss"], alone.callback_metrics["val_loss"])
        best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
        assert Path(best).parent == tmp_path / f"ckpt{i}" and Path(best).exists()

    spans = sorted(sweep.spans, key=lambda s: s.start_s)
    assert {s.device for s in spans[:2]} == {0, 1}
    assert spans[0].model == "3:MLP"  # the most work first: its length in steps is not known (`max_epochs`)
    assert spans[0].start_s < spans[1].end_s and spans[1].start_s < spans[0].end_s, "both devices at once"


def test_a_failing_model_fails_alone_and_the_others_finish():
    """A model whose step raises fails with its error (its exception, sent back from the worker); the others train
    on exactly as alone."""
    torch.manual_seed(0)
    failing, healthy = MLP(32, 3, fail_at=3), MLP(48, 2)
    reference = copy.deepcopy(healthy)
    sweep = MultiModelTrainer(devices=2, enable_progress_bar=False, processes=True)
    sweep.add(failing, train_dataloaders=regression_data(32), max_steps=8, name="failing", logger=False)
    sweep.add(healthy, train_dataloaders=regression_data(48), max_steps=8, name="healthy", logger=False)
    trainers = sweep.fit()

    failed, finished = sweep.results
    assert (failed.status, finished.status) == ("failed", "finished")
    assert isinstance(failed.error, ValueError) and "bad batch at step 3" in str(failed.error)
    assert failed.steps == trainers[0].global_step == 3
    fit_alone(reference, regression_data(48), max_steps=8)
    assert_same_weights(healthy, reference)


class KillsItsWorker(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_that_dies_fails_its_model_and_the_other_worker_trains_the_rest():
    sweep = MultiModelTrainer(devices=2, enable_progress_bar=False, processes=True)
    sweep.add(
        MLP(32, 2),
        train_dataloaders=regression_data(32),
        max_steps=50,
        name="killed",
        callbacks=[KillsItsWorker()],
        **QUIET_LOGS,
    )
    for i in range(3):
        sweep.add(MLP(16, 2), train_dataloaders=regression_data(16), max_steps=4, name=f"small{i}", **QUIET_LOGS)
    sweep.fit()
    statuses = {r.name: r.status for r in sweep.results}
    assert statuses == {"killed": "failed", "small0": "finished", "small1": "finished", "small2": "finished"}
    assert "died (exit code -9)" in str(sweep.results[0].error)


QUIET_LOGS = {"logger": False, "enable_checkpointing": False}


class SigtermTheSweep(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            os.kill(os.getppid(), signal.SIGTERM)


def test_sigterm_stops_the_running_models_with_their_checkpoints_and_starts_no_other(tmp_path):
    """SIGTERM to the sweep's process stops each running model at its next batch (its checkpoints kept: it resumes
    mid-epoch exactly as uninterrupted, as from a sweep in threads) and starts none of those waiting."""
    torch.manual_seed(0)
    model = MLP(32, 3)
    uninterrupted = copy.deepcopy(model)
    previous = signal.getsignal(signal.SIGTERM)
    sweep = MultiModelTrainer(devices=1, enable_progress_bar=False, processes=True)
    checkpoints = ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
    sweep.add(model, train_dataloaders=regression_data(32), max_steps=40, name="long", logger=False,
              callbacks=[checkpoints, SigtermTheSweep()])  # fmt: skip
    sweep.add(MLP(16, 2), train_dataloaders=regression_data(16), max_steps=4, name="waiting", **QUIET_LOGS)
    sweep.fit()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert [r.status for r in sweep.results] == ["stopped", "stopped"]
    assert all(isinstance(r.error, SweepStopped) for r in sweep.results)
    assert "before this model started" in str(sweep.results[1].error)
    last = max(tmp_path.iterdir(), key=lambda p: int(p.stem.split("step=")[1]))
    assert 3 <= int(last.stem.split("step=")[1]) < 40

    resumed = MLP(32, 3)
    L.Trainer(accelerator="cpu", devices=1, max_steps=40, strategy=SpillingStrategy(), **QUIET).fit(
        resumed, regression_data(32), ckpt_path=str(last)
    )
    fit_alone(uninterrupted, regression_data(32), max_steps=40)
    assert_same_weights(resumed, uninterrupted)


QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def test_what_worker_processes_cannot_do_is_refused():
    with pytest.raises(ValueError, match="on CPU cores"):
        MultiModelTrainer(accelerator="gpu", processes=True)
