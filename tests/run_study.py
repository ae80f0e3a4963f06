"""A worker of an Optuna study trained with `MultiModelTrainer.optimize`, as a user's script would be, for the model
selection tests: ``python run_study.py FOLDER CONFIG_JSON``.

The study lives in ``FOLDER/study.log`` (a journal file), the trials' checkpoints in ``FOLDER/checkpoints``. Every
trial trains `tests.study_models.regression_mlp` and appends each step's loss to ``FOLDER/losses/trial-<n>.jsonl``
as it goes (so a killed worker leaves what it trained); the worker prints ``started trial <n>`` as each trial's
training starts, for the tests to time signals by. ``die_at_validation: {"trial": n, "step": s}`` kills the worker as
trial n's validation after step s starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import optuna

sys.path.insert(0, os.path.dirname(__file__))
from study_models import LossLog, trial_kwargs  # noqa: E402

from lightning_varuna import MultiModelTrainer  # noqa: E402


class SaysStarted(L.Callback):
    def __init__(self, number: int) -> None:
        self.number = number

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        print(f"started trial {self.number}", flush=True)


class DiesAtValidation(L.Callback):
    """Kills its worker (SIGKILL) as the validation after global step ``step`` starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    folder, config = Path(sys.argv[1]), json.loads(sys.argv[2])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.log")))
    study = optuna.create_study(
        study_name="study", storage=storage, load_if_exists=True, direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=config.get("seed")), pruner=optuna.pruners.NopPruner(),
    )  # fmt: skip

    def build(trial: optuna.trial.Trial) -> dict:
        trial.set_user_attr("pid", os.getpid())  # the worker process that trains it
        kwargs = trial_kwargs(trial, config["max_steps"], config.get("dropout", 0.0))
        kwargs["callbacks"] = [LossLog(folder / "losses" / f"trial-{trial.number}.jsonl"), SaysStarted(trial.number)]
        if trial.number == config.get("die_at_validation", {}).get("trial"):
            kwargs["callbacks"].append(DiesAtValidation(config["die_at_validation"]["step"]))
        return kwargs

    sweep = MultiModelTrainer(
        accelerator="cpu", devices=config.get("devices", 1), checkpoint_dir=str(folder / "checkpoints"),
        enable_progress_bar=False, processes=config.get("processes", False),
    )  # fmt: skip
    sweep.optimize(
        study, build, n_trials=config["n_trials"], monitor="val_loss", max_running=config.get("max_running"),
        checkpoint_interval=config.get("checkpoint_interval", 300.0), heartbeat_interval=config.get("heartbeat", 10.0),
        grace_period=config.get("grace_period", 120.0),
    )  # fmt: skip
    print("worker done", flush=True)


if __name__ == "__main__":
    main()
