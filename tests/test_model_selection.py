"""`MultiModelTrainer.optimize`: an Optuna study trained as one sweep. Each trial trains as if alone (per-step losses
and weights of plain Lightning), a pruned trial ends at its next step boundary and another takes its place, a failing
trial fails alone, a preempted worker's trials resume exactly on the next run, and a killed worker's trials are
taken over by another worker from their last checkpoint."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

optuna = pytest.importorskip("optuna", reason="model selection needs Optuna: pip install lightning-varuna[optuna]")
from conftest import children_of, clean_env  # noqa: E402
from real_models import HFImageClassifier  # noqa: E402
from study_models import (  # noqa: E402
    VAL_EVERY,
    LossLog,
    fit_kwargs,
    logged_losses,
    regression_mlp,
    train_alone,
    trial_kwargs,
)

from lightning_varuna import MultiModelTrainer  # noqa: E402
from lightning_varuna._optuna_private import as_new_worker, set_user_attr  # noqa: E402
from lightning_varuna.demos import MLP  # noqa: E402
from lightning_varuna.multimodel.core_lending import CoreLending  # noqa: E402
from lightning_varuna.multimodel.devices import torch_threads  # noqa: E402
from lightning_varuna.multimodel.report import StudyDisplay  # noqa: E402
from lightning_varuna.multimodel.study import HANDED_OVER, HEARTBEAT, RESUMES, SURPLUS, StudyRunner  # noqa: E402
from lightning_varuna.multimodel.trial_callback import TrialCallback  # noqa: E402

RUNNER = str(Path(__file__).with_name("run_study.py"))


class PruneOddTrials(optuna.pruners.BasePruner):
    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number % 2 == 1


def optimize_in_process(
    tmp_path: Path, n_trials: int, max_steps: int, pruner: Any, failing: int | None = None, dropout: float = 0.0
):
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0), pruner=pruner)
    models: dict[int, Any] = {}

    def build(trial: optuna.trial.Trial) -> dict:
        if trial.number == failing:
            raise RuntimeError("this trial cannot be built")
        kwargs = trial_kwargs(trial, max_steps, dropout)
        models[trial.number] = kwargs["model"]
        kwargs["callbacks"] = [LossLog(tmp_path / "losses" / f"trial-{trial.number}.jsonl")]
        return kwargs

    sweep = MultiModelTrainer(accelerator="cpu", devices=2, checkpoint_dir=str(tmp_path / "ckpt"))
    outcomes = sweep.optimize(study, build, n_trials=n_trials, monitor="val_loss", max_running=3)
    return study, outcomes, models


def test_each_trial_trains_as_if_alone_and_a_pruned_trial_frees_its_place(tmp_path):
    """Six trials with dropout, three at a time on two devices; the odd ones are pruned at their first report (step
    4) and end there, and new trials take their places until the study holds six. Every trial's per-step losses, and
    the finished trials' weights, equal the trial trained alone with plain Lightning (its build seeds it)."""
    study, outcomes, models = optimize_in_process(
        tmp_path, n_trials=6, max_steps=12, pruner=PruneOddTrials(), dropout=0.1
    )
    states = {t.number: t.state.name for t in study.trials}
    assert states == {n: "PRUNED" if n % 2 else "COMPLETE" for n in range(6)}
    assert sorted(o.number for o in outcomes) == list(range(6))
    for trial in study.trials:
        losses, weights = train_alone(trial.params["layers"], trial.params["lr"], 12, dropout=0.1)
        logged = logged_losses(tmp_path / "losses" / f"trial-{trial.number}.jsonl")
        steps = 4 if trial.number % 2 else 12
        assert sorted(logged) == list(range(1, steps + 1)), "a pruned trial ends at the step boundary after its report"
        torch.testing.assert_close(list(logged.values()), losses[:steps], rtol=1e-5, atol=1e-6)
        if trial.state.name == "COMPLETE":
            for name, tensor in models[trial.number].state_dict().items():
                torch.testing.assert_close(tensor, weights[name], rtol=1e-5, atol=1e-6, msg=name)
            assert trial.value == pytest.approx(trial.intermediate_values[12])


def test_trials_train_in_worker_processes_each_as_if_alone(tmp_path, capsys):
    """``processes=True``: each of 2 forked worker processes runs the study's trials (with dropout) one at a time,
    sharing it through its journal; the odd trials are pruned at their first report. Every trial's per-step losses
    equal it trained alone, the outcomes of both processes come back, and the display's line says how the study
    ended, under what the workers warned."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log")))
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=0), pruner=PruneOddTrials())

    def build(trial: optuna.trial.Trial) -> dict:
        trial.set_user_attr("pid", os.getpid())
        warnings.warn(f"trial {trial.number} trains on little data", stacklevel=1)
        kwargs = trial_kwargs(trial, max_steps=12, dropout=0.1)
        kwargs["callbacks"] = [LossLog(tmp_path / "losses" / f"trial-{trial.number}.jsonl")]
        return kwargs

    sweep = MultiModelTrainer(devices=2, checkpoint_dir=str(tmp_path / "ckpt"), processes=True)
    outcomes = sweep.optimize(study, build, n_trials=4, monitor="val_loss")
    assert [(o.number, o.state) for o in outcomes] == [(0, "complete"), (1, "pruned"), (2, "complete"), (3, "pruned")]
    shown = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", capsys.readouterr().err)
    assert re.search(r"study .*: 2 complete, 2 pruned; best val_loss", shown), shown[-2000:]
    assert sorted(re.findall(r"UserWarning: trial (\d) trains on little data", shown)) == ["0", "1", "2", "3"]
    # Both workers may have asked at once for the last trial: one asked beyond the four was given back unbuilt.
    trials = [t for t in study.trials if SURPLUS not in t.user_attrs]
    assert all(t.state.name == "FAIL" and "pid" not in t.user_attrs for t in study.trials if t not in trials)
    pids = {t.user_attrs["pid"] for t in trials}
    assert len(pids) == 2 and os.getpid() not in pids
    drawn = [tuple(t.params.values()) for t in trials]
    assert len(set(drawn)) == 4, f"the workers' seeded samplers drew alike: {drawn}"
    for trial in trials:
        losses, _ = train_alone(trial.params["layers"], trial.params["lr"], 12, dropout=0.1)
        logged = logged_losses(tmp_path / "losses" / f"trial-{trial.number}.jsonl")
        steps = 4 if trial.number % 2 else 12
        assert sorted(logged) == list(range(1, steps + 1))
        torch.testing.assert_close(list(logged.values()), losses[:steps], rtol=1e-5, atol=1e-6)


def test_workers_that_ask_at_once_give_back_a_trial_beyond_n_trials(tmp_path):
    """Two workers both count a study of ``n_trials=2`` one short (it holds one finished trial) and both ask at that
    moment: the trial numbered beyond the two is given back unbuilt (told FAIL, marked `SURPLUS`, not counted), the
    other trains. A trial the user enqueues into the full study still runs."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    distributions = {"layers": optuna.distributions.IntDistribution(2, 5)}
    study.add_trial(optuna.trial.create_trial(params={"layers": 2}, distributions=distributions, value=1.0))
    built: list[int] = []

    def build(trial: optuna.trial.Trial) -> dict:
        built.append(trial.number)
        return trial_kwargs(trial, max_steps=VAL_EVERY)

    both_counted = threading.Barrier(2)

    def worker(asking_together: bool) -> None:
        asked = [False]

        def idle(idle: bool) -> None:  # told "not idle" after counting the study and before asking
            if asking_together and not idle and not asked[0]:
                asked[0] = True
                both_counted.wait(timeout=60)

        sweep = MultiModelTrainer(accelerator="cpu", devices=1, enable_progress_bar=False)
        StudyRunner(
            sweep, study, build, 2, "val_loss", "last", str(tmp_path / "ckpt"), 300.0, 10.0, 120.0, 1,
            threading.Event(), idle=idle,
        ).run()  # fmt: skip

    workers = [threading.Thread(target=worker, args=(True,)) for _ in range(2)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in workers), "a worker did not end"
    assert [(t.number, t.state.name, SURPLUS in t.user_attrs) for t in study.trials] == [
        (0, "COMPLETE", False), (1, "COMPLETE", False), (2, "FAIL", True),
    ]  # fmt: skip
    assert built == [1]

    study.enqueue_trial({"layers": 3, "lr": 0.01})
    worker(asking_together=False)
    assert built == [1, 3] and study.trials[3].state.name == "COMPLETE" and study.trials[3].params["layers"] == 3


class ThreadsLog(L.Callback):
    """Appends each step's loss, time, torch's threads and the cores its thread may run on to ``path``; saves the
    final weights beside it. With ``widened``: stops the fit once that many steps ran on more than one core (or after
    a minute)."""

    def __init__(self, path: Path, widened: int | None = None) -> None:
        self.path, self.widened, self.started = path, widened, time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        step = {"loss": float(outputs["loss"]), "at": time.time(), "threads": torch.get_num_threads()}
        step["cores"] = len(os.sched_getaffinity(0))
        with open(self.path, "a") as f:
            f.write(json.dumps(step) + "\n")
        if self.widened is not None:
            self.widened -= step["cores"] > 1
            trainer.should_stop = self.widened <= 0 or time.monotonic() - self.started > 60

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(pl_module.state_dict(), self.path.with_suffix(".pt"))


class WaitsFor(L.Callback):
    """Waits after step ``at_step`` until ``path`` exists (at most a minute)."""

    def __init__(self, path: Path, at_step: int) -> None:
        self.path, self.at_step = path, at_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        deadline = time.monotonic() + 60
        while trainer.global_step == self.at_step and not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def wide_trial(trial: optuna.trial.Trial, max_steps: int) -> tuple[L.LightningModule, dict[str, Any]]:
    """A trial's model wide enough for torch to split its steps between threads, and how it is fitted."""
    torch.manual_seed(trial.suggest_int("seed", 0, 0))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=generator)
    data = DataLoader(TensorDataset(x, torch.tanh(x.roll(1, 1))), batch_size=64)
    fit = dict(train_dataloaders=data, val_dataloaders=data, max_steps=max_steps, val_check_interval=4)
    return MLP(512, 3, lr=0.01, optimizer="sgd"), fit


def until_both_asked(folder: Path, trial: optuna.trial.Trial) -> None:
    """Wait until trials 0 and 1 have both been asked (by then each of 2 workers holds one)."""
    (folder / f"asked-{trial.number}").touch()
    deadline = time.monotonic() + 60
    while not all((folder / f"asked-{n}").exists() for n in (0, 1)):
        assert time.monotonic() < deadline, "the other worker asked no trial within a minute"
        time.sleep(0.01)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="lending a core needs two")
def test_a_worker_with_no_trial_left_lends_its_core_to_the_trial_still_training(tmp_path):
    """``processes=True`` on 2 cores, a study of 2 trials, one per worker: a short one and a long one. While both
    train, each computes with one thread on its own core; once the short trial's worker has no trial left to ask,
    the long trial's steps compute with 2 threads on both cores. Each still trains as alone on one thread: the same
    per-step losses and final weights. This process computes on 2 threads first, as a user's script may: a forked
    worker's main thread keeps that OpenMP team, where a step on 2 threads would hang."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log")))
    study = optuna.create_study(storage=storage)
    with torch_threads(2):
        (torch.randn(512, 512) @ torch.randn(512, 512)).sum()

    def build(trial: optuna.trial.Trial) -> dict:
        until_both_asked(tmp_path, trial)
        model, fit = wide_trial(trial, max_steps=4 if trial.number == 0 else 10_000)
        log = ThreadsLog(tmp_path / f"trial-{trial.number}.jsonl", widened=None if trial.number == 0 else 10)
        return dict(model=model, callbacks=[log], **fit)

    sweep = MultiModelTrainer(devices=2, checkpoint_dir=str(tmp_path / "ckpt"), processes=True)
    sweep.optimize(study, build, n_trials=2, monitor="val_loss")
    logged = {n: list(map(json.loads, (tmp_path / f"trial-{n}.jsonl").read_text().splitlines())) for n in (0, 1)}
    short_ended = logged[0][-1]["at"]
    while_both = [(s["threads"], s["cores"]) for s in logged[0] + [s for s in logged[1] if s["at"] < short_ended]]
    assert set(while_both) == {(1, 1)}, "while both train, each on its own core"
    assert (logged[1][-1]["threads"], logged[1][-1]["cores"]) == (2, 2), "the long trial ends on both cores"
    for number, steps in logged.items():
        model, fit = wide_trial(study.trials[number], max_steps=len(steps))
        losses = LossLog(tmp_path / f"alone-{number}.jsonl")
        trainer = L.Trainer(
            max_steps=len(steps), val_check_interval=4, callbacks=[losses], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        with torch_threads(1):
            trainer.fit(model, fit["train_dataloaders"], fit["val_dataloaders"])
        alone = logged_losses(losses.path)
        torch.testing.assert_close([step["loss"] for step in steps], list(alone.values()), rtol=1e-5, atol=1e-6)
        weights = torch.load(tmp_path / f"trial-{number}.pt")
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning is seen with two cores or more")
def test_worker_processes_of_a_sweep_that_does_not_pin_run_where_the_os_puts_them(tmp_path):
    """``sweep.scheduler.pin = False`` (a machine shared with other jobs) reaches the worker processes: every step of
    each trial may run on any of the process's cores, on one thread, and no worker lends its core when it is idle."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log")))
    study = optuna.create_study(storage=storage)

    def build(trial: optuna.trial.Trial) -> dict:
        model, fit = wide_trial(trial, max_steps=4 if trial.number == 0 else 12)
        return dict(model=model, callbacks=[ThreadsLog(tmp_path / f"trial-{trial.number}.jsonl")], **fit)

    sweep = MultiModelTrainer(devices=2, checkpoint_dir=str(tmp_path / "ckpt"), processes=True)
    sweep.scheduler.pin = False
    sweep.optimize(study, build, n_trials=2, monitor="val_loss")
    every_core = len(os.sched_getaffinity(0))
    for n in (0, 1):
        steps = [json.loads(line) for line in (tmp_path / f"trial-{n}.jsonl").read_text().splitlines()]
        assert {(step["threads"], step["cores"]) for step in steps} == {(1, every_core)}


class ConvNet(HFImageClassifier):
    """Hugging Face's ResNet wide enough that oneDNN splits a convolution's weight gradient between threads."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1], num_labels=4)
        self.model = ResNetForImageClassification(config)


def conv_trial(trial: optuna.trial.Trial, max_steps: int) -> tuple[L.LightningModule, dict[str, Any]]:
    torch.manual_seed(trial.suggest_int("seed", 0, 0))
    generator = torch.Generator().manual_seed(0)
    images = TensorDataset(
        torch.randn(64, 3, 64, 64, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    )
    data = DataLoader(images, batch_size=8)
    return ConvNet(), dict(train_dataloaders=data, val_dataloaders=data, max_steps=max_steps, val_check_interval=4)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="lending a core needs two")
def test_a_trial_that_asks_for_determinism_borrows_no_core(tmp_path):
    """On 2 threads a convolution's weight gradient differs from one thread's in its last bits, and SGD carries that
    on; a trial with Lightning's ``deterministic=True`` keeps one thread on its own core after the other worker has
    no trial left, and trains bit for bit as plain Lightning on one thread."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log")))
    study = optuna.create_study(storage=storage)

    def build(trial: optuna.trial.Trial) -> dict:
        until_both_asked(tmp_path, trial)
        model, fit = conv_trial(trial, max_steps=4 if trial.number == 0 else 24)
        callbacks: list[L.Callback] = [ThreadsLog(tmp_path / f"trial-{trial.number}.jsonl")]
        if trial.number == 1:  # the short trial ends (and saves its weights) while the long one trains
            callbacks.append(WaitsFor(tmp_path / "trial-0.pt", at_step=12))
        return dict(model=model, callbacks=callbacks, deterministic=True, **fit)

    sweep = MultiModelTrainer(devices=2, checkpoint_dir=str(tmp_path / "ckpt"), processes=True)
    sweep.optimize(study, build, n_trials=2, monitor="val_loss")
    logged = {n: list(map(json.loads, (tmp_path / f"trial-{n}.jsonl").read_text().splitlines())) for n in (0, 1)}
    assert [s for s in logged[1] if s["at"] > logged[0][-1]["at"]], "the long trial trains on after the short one"
    assert {(s["threads"], s["cores"]) for s in logged[1]} == {(1, 1)}
    model, fit = conv_trial(study.trials[1], max_steps=24)
    losses = LossLog(tmp_path / "alone.jsonl")
    trainer = L.Trainer(
        max_steps=24, val_check_interval=4, deterministic=True, callbacks=[losses], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with torch_threads(1):
        trainer.fit(model, fit["train_dataloaders"], fit["val_dataloaders"])
    assert [step["loss"] for step in logged[1]] == list(logged_losses(losses.path).values())
    weights = torch.load(tmp_path / "trial-1.pt")
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())


def test_idle_workers_cores_are_shared_out_in_turn_among_the_workers_that_train():
    lending = CoreLending([10, 11, 12, 13], multiprocessing.get_context("fork"))
    assert [lending.borrowed(k) for k in range(4)] == [(), (), (), ()]
    lending.set_idle(3, True)
    assert [lending.borrowed(k) for k in range(4)] == [(13,), (), (), ()]
    lending.set_idle(1, True)
    assert [lending.borrowed(k) for k in range(4)] == [(11,), (), (13,), ()]
    lending.set_idle(0, True)
    assert [lending.borrowed(k) for k in range(4)] == [(), (), (10, 11, 13), ()]
    lending.set_idle(1, False)
    assert [lending.borrowed(k) for k in range(4)] == [(), (10,), (13,), ()]


def test_worker_processes_need_a_study_they_can_share(tmp_path):
    sweep = MultiModelTrainer(devices=2, checkpoint_dir=str(tmp_path), processes=True)
    with pytest.raises(ValueError, match="a study in memory cannot be shared"):
        sweep.optimize(optuna.create_study(), lambda trial: {}, n_trials=1, monitor="val_loss")


def _touch_a_finished_trial(study: optuna.Study) -> None:
    as_new_worker(study)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        set_user_attr(study, 0, "late", True)  # written to the journal, refused when this process reads it back


def test_a_forked_worker_s_refused_updates_are_not_its_parent_s_mistakes(tmp_path):
    """A worker process forked from the sweep's writes to the journal as a worker of its own: an update it makes to a
    finished trial (a heartbeat of a trial another worker has handed over) is its own refused update, and the parent
    reading the journal afterwards is not told it made it."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log")))
    study = optuna.create_study(storage=storage)
    study.tell(study.ask(), 1.0)
    worker = multiprocessing.get_context("fork").Process(target=_touch_a_finished_trial, args=(study,))
    worker.start()
    worker.join()
    assert worker.exitcode == 0
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"]


@pytest.mark.slow  # waits out a slow build
def test_running_trials_say_they_are_alive_while_a_slow_build_holds_the_worker_up(tmp_path):
    """A build that takes four heartbeats (a dataset loaded, a large model made) holds up the worker's loop, not the
    heartbeats of the trial already training: another worker would find it alive and leave it."""
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0))
    seen: list[tuple[str, float]] = []  # trial 0's state and how long it had been silent, once trial 1 was built

    def build(trial: optuna.trial.Trial) -> dict:
        if trial.number == 1:
            time.sleep(2.0)
            first = study.trials[0]
            seen.append((first.state.name, time.time() - first.user_attrs[HEARTBEAT]))
        return trial_kwargs(trial, max_steps=400 if trial.number == 0 else 8)

    sweep = MultiModelTrainer(accelerator="cpu", devices=1, checkpoint_dir=str(tmp_path / "ckpt"))
    sweep.optimize(study, build, n_trials=2, monitor="val_loss", max_running=2, heartbeat_interval=0.5)
    ((state, silent_s),) = seen
    assert state == "RUNNING" and silent_s < 1.5


def test_a_trial_handed_over_while_it_trains_ends_leaving_its_checkpoint_as_it_was(tmp_path):
    """Another worker hands over a trial that still trains (its heartbeats came too late): when the trial comes to
    checkpoint next, it finds itself told and ends there instead, so the checkpoint its retry resumes from is not
    replaced while the retry reads it."""
    study = optuna.create_study()
    trial = study.ask()
    url = str(tmp_path / "trial-0.ckpt")
    callback = TrialCallback(trial, "val_loss", url, 0.0, threading.Event(), minimize=True)

    class HandedOverAtStep3(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # as the other worker does

    kwargs = fit_kwargs(max_steps=10)
    loaders = {name: kwargs.pop(name) for name in ("train_dataloaders", "val_dataloaders")}
    callbacks = [HandedOverAtStep3(), callback]
    trainer = L.Trainer(accelerator="cpu", callbacks=callbacks, enable_progress_bar=False, **kwargs)
    trainer.fit(regression_mlp(2, 0.01), **loaders)
    assert trainer.global_step == 3 and callback.handed_over
    assert torch.load(url, weights_only=False)["global_step"] == 2, "the checkpoint of step 3 was not written"


def test_a_trial_told_by_another_worker_as_it_ends_is_recorded_as_handed_over(tmp_path):
    """Another worker hands a trial over after its last report, as it ends (its heartbeats came too late): the trial is
    recorded as handed over, not as complete with a value that the study does not hold, and the study goes on."""
    study = optuna.create_study()

    class ToldAsItEnds(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            study.tell(0, state=optuna.trial.TrialState.FAIL)  # as the other worker's hand-over does

    def build(trial: optuna.trial.Trial) -> dict:
        return {**trial_kwargs(trial, max_steps=8), "callbacks": [ToldAsItEnds()] if trial.number == 0 else []}

    sweep = MultiModelTrainer(accelerator="cpu", devices=1, checkpoint_dir=str(tmp_path), enable_progress_bar=False)
    outcomes = sweep.optimize(study, build, n_trials=2, monitor="val_loss")
    assert [(o.number, o.state, o.value is None) for o in outcomes] == [
        (0, "handed over", True),
        (1, "complete", False),
    ]


def test_a_trial_that_fails_is_marked_failed_and_the_others_go_on(tmp_path):
    study, outcomes, _ = optimize_in_process(
        tmp_path, n_trials=3, max_steps=4, pruner=optuna.pruners.NopPruner(), failing=1
    )
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert "this trial cannot be built" in study.trials[1].user_attrs["fail_reason"]
    assert [o.state for o in sorted(outcomes, key=lambda o: o.number)] == ["complete", "failed", "complete"]


class LogsAs(MLP):
    """The trial's MLP, whose validation logs ``name`` (its loss, or NaN: a diverged trial's)."""

    def __init__(self, name: str, nan: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name, self.nan = name, nan

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log(self.name, float("nan") if self.nan else torch.nn.functional.mse_loss(self(x), y))


def test_a_trial_built_or_logged_wrongly_fails_saying_what_to_change(tmp_path):
    """A `build` that returns the model alone, one that returns a `ckpt_path` (the study's to set), a validation that
    logs no `monitor` (misspelled: a warning at the first, and the trial fails listing what it logged instead),
    a diverged trial (its value NaN, with `value="last"` and `"best"`): each fails with what to change; a trial built
    right completes."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner())

    def build(trial: optuna.trial.Trial) -> Any:
        kwargs = trial_kwargs(trial, max_steps=12)
        if trial.number == 0:
            return kwargs["model"]
        if trial.number == 1:
            return {**kwargs, "ckpt_path": "last"}
        if trial.number in (2, 3, 8):
            kwargs["model"] = LogsAs("val_los" if trial.number == 2 else "val_loss", nan=trial.number != 2, width=16)
        return kwargs

    outcomes = {}
    for value in ("last", "best"):
        sweep = MultiModelTrainer(devices=2, checkpoint_dir=str(tmp_path / value), enable_progress_bar=False)
        for outcome in sweep.optimize(study, build, n_trials=len(study.trials) + 5, monitor="val_loss", value=value):
            outcomes[outcome.number] = outcome
    reasons = {t.number: t.user_attrs.get("fail_reason", "") for t in study.trials}
    assert "returns what `MultiModelTrainer.add` takes, as a dict" in reasons[0] and "returned MLP" in reasons[0]
    assert "returned ['ckpt_path'], which the study sets" in reasons[1]
    assert "logged no `val_loss` after its validations, but ['train_loss', 'val_los']" in reasons[2]
    assert "last `val_loss` is not a number" in reasons[3] and "best `val_loss` is not a number" in reasons[8]
    assert outcomes[3].state == outcomes[8].state == "failed"
    assert [t.number for t in study.trials if t.state.name == "COMPLETE"] == [4, 5, 6, 7, 9]


class FailAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            raise RuntimeError("this trial's step failed")


def optimize_counting_running(tmp_path: Path, n_trials: int) -> tuple[optuna.Study, list[int]]:
    """A study of ``n_trials`` run on 2 devices as `optimize` runs it by default, and how many of its trials were
    running as each was built (itself included)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    running_at_build: list[int] = []

    def build(trial: optuna.trial.Trial) -> dict:
        running_at_build.append(len(study.get_trials(states=(optuna.trial.TrialState.RUNNING,))))
        return trial_kwargs(trial, max_steps=8)

    sweep = MultiModelTrainer(accelerator="cpu", devices=2, checkpoint_dir=str(tmp_path / "ckpt"))
    sweep.optimize(study, build, n_trials=n_trials, monitor="val_loss")
    return study, running_at_build


def test_by_default_as_many_trials_train_at_once_as_there_are_devices(tmp_path):
    """More trials at once than devices let the pruner decide with fewer trials at each rung (see
    docs/model-selection.md): by default a worker trains one per device."""
    study, running_at_build = optimize_counting_running(tmp_path, n_trials=4)
    assert len(running_at_build) == 4 and max(running_at_build) == 2


def test_a_trial_waits_for_host_memory_that_holds_it(tmp_path, monkeypatch, caplog):
    """On a host with less memory available than a trial was measured to need, the next trial starts only once a
    running one has ended, devices free or not; and the worker says why."""
    monkeypatch.setattr("lightning_varuna.multimodel.study.available_host_bytes", lambda: 1024)
    with caplog.at_level("INFO", logger="lightning_varuna.multimodel.study"):
        study, running_at_build = optimize_counting_running(tmp_path, n_trials=3)
    assert running_at_build == [1, 1, 1]
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert "1.0 KiB of host memory is available" in caplog.text and "starts once one ends" in caplog.text


def test_a_trial_s_row_says_how_it_ended(tmp_path, capsys):
    """The display's row of a trial that the pruner stopped says "pruned" (not that it stopped early), and a trial
    whose fit raised says "failed"."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), pruner=PruneOddTrials())

    def build(trial: optuna.trial.Trial) -> dict:
        kwargs = trial_kwargs(trial, max_steps=8)
        kwargs["callbacks"] = [FailAtStep(2)] if trial.number == 2 else []
        return kwargs

    sweep = MultiModelTrainer(accelerator="cpu", devices=2, checkpoint_dir=str(tmp_path / "ckpt"))
    outcomes = sweep.optimize(study, build, n_trials=3, monitor="val_loss", max_running=3)
    assert {o.number: o.state for o in outcomes} == {0: "complete", 1: "pruned", 2: "failed"}
    shown = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", capsys.readouterr().err)
    for number, ended in (0, "complete"), (1, "pruned"), (2, "failed"):  # on the trial's row, after its name
        assert re.search(rf"trial {number} \([^\r\n]*{ended}", shown), (number, shown[-3000:])
    assert "stopped early" not in shown


def test_a_row_taken_by_the_next_trial_no_longer_says_how_the_last_one_ended(capsys):
    display = StudyDisplay(rows=1, study_name="s")
    display.started("trial 0", 8, 0)
    display.ended("trial 0", "pruned")
    display.started("trial 1", 8, 0)
    display.close()
    shown = capsys.readouterr().err
    assert "trial 1" in shown and not re.search(r"trial 1[^\r\n]*pruned", shown), shown


def test_a_study_needs_a_checkpoint_folder_and_one_objective(tmp_path):
    study = optuna.create_study()
    with pytest.raises(ValueError, match=r"checkpoint_dir=\.\.\."):
        MultiModelTrainer().optimize(study, lambda trial: {}, n_trials=1, monitor="val_loss")
    with pytest.raises(OSError, match="Cannot write checkpoints to '/proc/checkpoints'"):
        MultiModelTrainer(checkpoint_dir="/proc/checkpoints").optimize(study, lambda t: {}, n_trials=1, monitor="v")
    two = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ValueError, match="one objective"):
        MultiModelTrainer(checkpoint_dir=str(tmp_path)).optimize(two, lambda trial: {}, n_trials=1, monitor="v")


# ------------------------------------------------------------------------------------------ workers that stop
def start_worker(folder: Path, **config: Any) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, RUNNER, str(folder), json.dumps(config)], cwd=folder, env=clean_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def wait_for_steps(folder: Path, trials: int, steps: int, timeout: float = 120) -> None:
    """Until ``trials`` trials have logged ``steps`` steps each."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = list((folder / "losses").glob("trial-*.jsonl")) if (folder / "losses").exists() else []
        if sum(len(p.read_text().splitlines()) >= steps for p in logs) >= trials:
            return
        time.sleep(0.1)
    raise TimeoutError(f"no {trials} trials reached {steps} steps in {timeout} s")


def wait_for_running(folder: Path, trials: int, steps: int, timeout: float = 120) -> None:
    """Until ``trials`` trials still running have logged ``steps`` steps each."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            running = [t.number for t in study_in(folder).trials if t.state.name == "RUNNING"]
        except KeyError:  # the worker has not created the study yet
            running = []
        logs = [folder / "losses" / f"trial-{number}.jsonl" for number in running]
        if sum(p.exists() and len(p.read_text().splitlines()) >= steps for p in logs) >= trials:
            return
        time.sleep(0.1)
    raise TimeoutError(f"no {trials} running trials reached {steps} steps in {timeout} s")


def freeze_at_a_checkpointed_trial(group: int, folder: Path, timeout: float = 120) -> optuna.trial.FrozenTrial:
    """Stop (SIGSTOP) the processes of ``group`` at a moment when one of their trials runs and has committed a
    checkpoint; that trial. (Seen without stopping them, such a trial could end before a signal that follows lands.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.killpg(group, signal.SIGSTOP)
        running = [t for t in study_in(folder).trials if t.state.name == "RUNNING"]
        checkpoints = [folder / "checkpoints" / f"trial-{t.number}" for t in running]
        checkpointed = [t for t, url in zip(running, checkpoints) if list(url.glob("v*/COMMITTED.json"))]
        if checkpointed:
            return checkpointed[0]
        os.killpg(group, signal.SIGCONT)
        time.sleep(0.1)
    raise TimeoutError(f"no running trial had committed a checkpoint under {folder} in {timeout} s")


def finish(worker: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = worker.communicate(timeout=timeout)
    assert worker.returncode == 0, output[-4000:]
    return output


def study_in(folder: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.log")))
    return optuna.load_study(study_name="study", storage=storage)


def counted_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The trials that count toward ``n_trials``: neither handed over to a retry nor given back as surplus."""
    return [t for t in study.trials if HANDED_OVER not in t.user_attrs and SURPLUS not in t.user_attrs]


def assert_every_trial_trained_as_alone(
    folder: Path, study: optuna.Study, max_steps: int, dropout: float = 0.0
) -> None:
    """Every step any trial logged (a handed-over trial's and its retry's) equals that step trained alone, it reported
    at its validations only (none as it stopped for its retry), and each trial that counts completed all its steps,
    those of the trials it continues included."""
    by_number = {t.number: t for t in study.trials}
    for trial in study.trials:
        if SURPLUS in trial.user_attrs:  # asked as another worker asked too, beyond n_trials: given back unbuilt
            assert trial.state.name == "FAIL" and not trial.params, trial.number
            continue
        reported = sorted(trial.intermediate_values)
        assert all(step % VAL_EVERY == 0 for step in reported), (trial.number, reported)
        losses, _ = train_alone(trial.params["layers"], trial.params["lr"], max_steps, dropout)
        logged = logged_losses(folder / "losses" / f"trial-{trial.number}.jsonl")
        for step, loss in logged.items():
            assert loss == pytest.approx(losses[step - 1], rel=1e-5, abs=1e-6), (trial.number, step)
        if HANDED_OVER in trial.user_attrs:
            continue
        assert trial.state.name == "COMPLETE", trial.number
        assert reported == list(range(VAL_EVERY, max_steps + 1, VAL_EVERY)), (trial.number, reported)
        covered, current = set(logged), trial
        while RESUMES in current.user_attrs:  # a retry: the steps before its checkpoint are the continued trial's
            current = by_number[current.user_attrs[RESUMES]["trial"]]
            covered |= set(logged_losses(folder / "losses" / f"trial-{current.number}.jsonl"))
            assert min(logged) > 1, "the retry resumed from a checkpoint, not from the start"
        assert covered == set(range(1, max_steps + 1)), trial.number


@pytest.mark.slow
def test_a_preempted_study_resumes_its_trials_on_the_next_run_exactly(tmp_path):
    """SIGTERM, passed on to the worker processes of ``processes=True`` (each a threaded one-device sweep, as without
    it), stops both running trials at a step boundary with a checkpoint; running the same command again resumes them
    (their retries continue from the checkpoints), completes the study's four trials and asks no more; every step
    equals the trial trained alone, dropout masks included. (A threaded sweep's preempted trial resumed by another
    worker: the SLURM test.)"""
    config = dict(n_trials=4, max_steps=300, devices=2, max_running=2, seed=0, processes=True, dropout=0.1)
    first = start_worker(tmp_path, **config)
    wait_for_running(tmp_path, trials=2, steps=10)
    first.send_signal(signal.SIGTERM)
    finish(first)
    interrupted = [t for t in study_in(tmp_path).trials if t.user_attrs.get(HANDED_OVER) == "preempted"]
    assert len(interrupted) == 2
    finish(start_worker(tmp_path, **config))
    study = study_in(tmp_path)
    counted = counted_trials(study)
    assert len(counted) == 4 and all(t.state.name == "COMPLETE" for t in counted)
    assert_every_trial_trained_as_alone(tmp_path, study, 300, dropout=0.1)


@pytest.mark.slow
def test_a_killed_worker_s_trial_is_taken_over_by_another_from_its_checkpoint(tmp_path):
    """Two workers share one journal; one is killed (SIGKILL) while it trains a trial (with dropout) that has
    checkpointed. The other, after the grace period without a heartbeat, hands that trial over to a retry that
    resumes from its last checkpoint; the study completes its four trials, none run twice, every step as alone."""
    config = dict(
        n_trials=4, max_steps=300, max_running=1, heartbeat=0.5, grace_period=3, checkpoint_interval=0.5, dropout=0.1
    )
    doomed = start_worker(tmp_path, seed=1, **config)
    wait_for_steps(tmp_path, trials=1, steps=10)
    killed_in = freeze_at_a_checkpointed_trial(doomed.pid, tmp_path)
    survivor = start_worker(tmp_path, seed=2, **config)
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()
    finish(survivor)
    study = study_in(tmp_path)
    taken_over = [t.number for t in study.trials if t.user_attrs.get(HANDED_OVER) == "no heartbeat"]
    assert taken_over == [killed_in.number]
    counted = counted_trials(study)
    assert len(counted) == 4 and all(t.state.name == "COMPLETE" for t in counted)
    assert_every_trial_trained_as_alone(tmp_path, study, 300, dropout=0.1)


@pytest.mark.slow
def test_a_worker_killed_after_a_checkpoint_and_before_its_report_loses_no_reported_value(tmp_path):
    """A worker dies (SIGKILL) as a trial's validation starts, at a step where its checkpoint interval is due. The
    checkpoint of that step waits for the value's report, so the retry, which does not validate again where it
    resumes, resumes from the step before and reports the value: every validation's value reaches the study."""
    config = dict(n_trials=2, max_steps=3 * VAL_EVERY, max_running=1, heartbeat=0.5, grace_period=3)
    doomed = start_worker(
        tmp_path, seed=1, checkpoint_interval=0, die_at_validation={"trial": 0, "step": 2 * VAL_EVERY}, **config
    )
    assert doomed.wait(timeout=120) == -signal.SIGKILL
    finish(start_worker(tmp_path, seed=2, checkpoint_interval=0, **config))
    study = study_in(tmp_path)
    assert [t.number for t in study.trials if t.user_attrs.get(HANDED_OVER) == "no heartbeat"] == [0]
    assert_every_trial_trained_as_alone(tmp_path, study, 3 * VAL_EVERY)


@pytest.mark.slow
def test_a_killed_worker_process_s_trial_is_taken_over_by_its_sibling(tmp_path):
    """``processes=True``: one of the two worker processes is killed (SIGKILL) while its trial trains with a
    checkpoint. The other, after the grace period, resumes that trial from its checkpoint; the call returns as the
    study completes its four trials, none run twice, every step as alone."""
    config = dict(n_trials=4, max_steps=300, devices=2, max_running=2, processes=True, seed=0)
    worker = start_worker(tmp_path, heartbeat=0.5, grace_period=4, checkpoint_interval=0.2, **config)
    wait_for_steps(tmp_path, trials=2, steps=10)
    assert len(children_of(worker.pid)) == 2
    killed_in = freeze_at_a_checkpointed_trial(worker.pid, tmp_path)  # the call's process and its workers
    os.kill(killed_in.user_attrs["pid"], signal.SIGKILL)  # the worker process that trains it
    os.killpg(worker.pid, signal.SIGCONT)
    output = finish(worker)
    assert "died (exit code -9)" in output
    study = study_in(tmp_path)
    assert [t.number for t in study.trials if t.user_attrs.get(HANDED_OVER) == "no heartbeat"] == [killed_in.number]
    counted = counted_trials(study)
    assert len(counted) == 4 and all(t.state.name == "COMPLETE" for t in counted)
    assert_every_trial_trained_as_alone(tmp_path, study, 300)


@pytest.mark.slow
def test_a_slurm_job_array_runs_one_study_and_a_preempted_task_s_trial_continues_on_the_other(tmp_path, slurm):
    """The script of docs/model-selection.md as a SLURM job array of two tasks (``srun`` in each) against one journal:
    they run one study. SLURM's notice of a preemption (SIGUSR1) to one task checkpoints its trial and hands it over;
    the other task resumes it from the checkpoint. The study completes its four trials, none run twice, every step
    as alone."""
    config = dict(n_trials=4, max_steps=300, max_running=1)
    command = f"srun {sys.executable} {RUNNER} {tmp_path} '{json.dumps(config)}'"
    output = f"--output={tmp_path}/slurm-%A_%a.out"  # each task's own output, as slurm.output names it
    job = slurm.sbatch(command, "--array=0-1", "--ntasks=1", output, cwd=tmp_path, env=clean_env())
    tasks = [f"{job}_0", f"{job}_1"]
    wait_for_running(tmp_path, trials=2, steps=10)  # both tasks train a trial
    subprocess.run(["scancel", "--signal=USR1", tasks[0]], env=slurm.env, check=True)
    states = [slurm.wait_until_ended(task, 300) for task in tasks]
    output = "\n".join(slurm.output(f"{job}_{i}", tmp_path) for i in (0, 1))
    assert states == ["COMPLETED", "COMPLETED"], output[-6000:]
    study = study_in(tmp_path)
    preempted = [t for t in study.trials if t.user_attrs.get(HANDED_OVER) == "preempted"]
    assert len(preempted) == 1, output[-6000:]
    counted = counted_trials(study)
    assert len(counted) == 4 and all(t.state.name == "COMPLETE" for t in counted)
    assert_every_trial_trained_as_alone(tmp_path, study, 300)
