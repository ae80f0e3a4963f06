"""Train the models of a sweep together (Hydra): each model is fitted by its own Lightning Trainer under
`SpillingStrategy` in its own thread, and its shards take turns on the sweep's devices, longest remaining time first
(`DeviceScheduler`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_varuna._torch_private import register_cuda_device_guard
from lightning_varuna.multimodel.core_lending import LentCores
from lightning_varuna.multimodel.devices import check_one_gpu, cores_for, staying_models, torch_threads
from lightning_varuna.multimodel.member import SweepMember, SweepMemberStrategy
from lightning_varuna.multimodel.member_callback import SweepMemberCallback
from lightning_varuna.multimodel.processes import WorkerCallback, WorkerStrategy, fit_in_processes
from lightning_varuna.multimodel.report import (
    ModelResult,
    StudyDisplay,
    SweepDisplay,
    device_timeline_trace,
    summary_table,
)
from lightning_varuna.multimodel.scheduler import DeviceScheduler, DeviceSpan, Ranking, SweepStopped
from lightning_varuna.multimodel.signals import preempted_by_signals, stopped_by_signals
from lightning_varuna.multimodel.study import StudyRunner, TrialOutcome
from lightning_varuna.multimodel.study_processes import optimize_in_processes
from lightning_varuna.partition.packing import format_bytes
from lightning_varuna.pipeline.replay import default_dtype, generator_states
from lightning_varuna.storage import Storage
from lightning_varuna.strategies.spilling import SpillingStrategy

if TYPE_CHECKING:
    import optuna

__all__ = ["MultiModelTrainer"]

_SET_BY_THE_SWEEP = ("accelerator", "devices", "strategy", "num_nodes")


class MultiModelTrainer:
    """Train several LightningModules at once, their shards interleaved over ``devices``.

    Each model added gets its own `lightning.pytorch.Trainer` (its own ``max_steps``, callbacks, logger,
    checkpoints...) under `SpillingStrategy`; while it trains, each shard's forward, backward and optimizer step waits
    for a free device, given to the model with the longest remaining time. On the CPU a device is one core: torch
    computes with one thread per device, and a turn on device k runs pinned to the process's k-th core. On a GPU
    (``accelerator="gpu"``) the models' shards take turns on the current CUDA device, spilled to pinned host memory
    (or ``spill_dir``) in between, unless the models stay there (``keep_on_device``).

    Args:
        accelerator: ``"cpu"``, or ``"gpu"`` (``"cuda"``) for one CUDA GPU.
        devices: how many devices the models share (on a GPU: 1).
        memory_budget: each model's `SpillingStrategy` budget (bytes or a string like ``"1GB"``): what one of its
            shards may hold on a device.
        spill_dir: a folder for the disk tier (each model gets its own subfolder); ``None`` keeps spilled shards in
            host memory.
        prefetch: fetch a model's next shard while its current one computes.
        storage_options: fsspec options for every checkpoint URL.
        enable_progress_bar: show one progress bar per model (the models' own Lightning bars are off by default).
        keep_on_device: keep each model that fits its budget in one shard on the device between its turns, instead
            of spilling it after each. ``None``: on a GPU, the models that save the most copies (the longest, by
            ``max_steps``, then the largest) while their parameters, gradients and optimizer state (four times
            their parameters) fit in half of what the GPU has free as `fit` starts; on the CPU, every such model
            unless ``spill_dir`` is set (host memory is the device's: spilling a model there would free nothing).
        checkpoint_dir: where `optimize` keeps each trial's checkpoint (any fsspec URL; the workers of one study
            share it).
        ranking: what a model's remaining time counts, which ranks it for the devices: ``"end"``, its time to its
            end; ``"expected"``, for a model that may end early (a trial a pruner may stop, or one added with
            ``next_decision``), its time to the next decision plus the share expected to go on of the rest.
        processes: on the CPU, train each model alone (under its `SpillingStrategy`) in one of ``devices`` worker
            processes forked as `fit` starts, the most work first, instead of interleaving the models' shards in
            threads of this process: faster for small models, whose steps are mostly Python, which one process runs
            a thread at a time. `fit` loads what each fit left (weights, progress, metrics, checkpoint paths) into
            its model and Trainer here. `optimize` runs a worker of the study in each process (a one-device sweep;
            this process shows the study as its storage has it; a worker with no trial left to ask lends its core to
            those still training); the trials' models here are not trained, their checkpoints and the study hold the
            results.
    """

    def __init__(
        self,
        accelerator: str = "cpu",
        devices: int = 1,
        memory_budget: int | float | str | None = None,
        spill_dir: str | Path | None = None,
        prefetch: bool = True,
        storage_options: dict[str, Any] | None = None,
        enable_progress_bar: bool = True,
        keep_on_device: bool | None = None,
        checkpoint_dir: str | Path | None = None,
        ranking: Ranking = "end",
        processes: bool = False,
    ) -> None:
        if accelerator not in ("cpu", "gpu", "cuda"):
            raise ValueError(f"MultiModelTrainer runs on 'cpu' or 'gpu' (CUDA), not accelerator={accelerator!r}.")
        if devices < 1:
            raise ValueError(f"`devices` must be at least 1, got {devices}.")
        if processes and accelerator != "cpu":
            raise ValueError("`processes=True` trains models on CPU cores; on a GPU the models share it in threads.")
        self.processes = processes
        self.on_gpu = accelerator != "cpu"
        if self.on_gpu:
            check_one_gpu(devices)
        self.devices = devices
        self.memory_budget, self.spill_dir, self.prefetch = memory_budget, spill_dir, prefetch
        self.storage_options = storage_options
        self.enable_progress_bar, self.keep_on_device = enable_progress_bar, keep_on_device
        self.checkpoint_dir = str(checkpoint_dir) if checkpoint_dir is not None else None
        if self.on_gpu:
            gpus = [torch.device("cuda", torch.cuda.current_device())]
            self.scheduler = DeviceScheduler(devices, gpus=gpus, ranking=ranking)
        else:
            self.scheduler = DeviceScheduler(devices, cores=cores_for(devices), ranking=ranking)
        self.results: list[ModelResult] = []
        self._members: list[SweepMember] = []
        self._display: SweepDisplay | StudyDisplay | None = None

    def add(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule | None = None,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        ckpt_path: str | None = None,
        *,
        name: str | None = None,
        next_decision: Callable[[pl.Trainer], tuple[float, float]] | None = None,
        **trainer_kwargs: Any,
    ) -> pl.Trainer:
        """Add ``model`` to the sweep, with what `Trainer(...)` (``trainer_kwargs``) and `Trainer.fit` take for it;
        ``name`` shows it in the progress display and the summary. ``next_decision(trainer)``, for a model that may
        end early: the global step of the next decision that may end it and the share of models that go on past
        such a decision (`optimize` passes its pruner's). Returns its Trainer.

        The model draws its random numbers (dropout) from torch's generator as it is now, as alone: seed and build it
        right before adding it, as before fitting it alone."""
        set_here = sorted(set(trainer_kwargs) & set(_SET_BY_THE_SWEEP))
        if set_here:
            raise ValueError(
                f"{set_here} are the sweep's: each model trains on the sweep's devices under its `SpillingStrategy`. "
                "Set `accelerator`, `devices` and the strategy's `memory_budget` on MultiModelTrainer, not in `add`."
            )
        if datamodule is not None and not isinstance(datamodule, pl.LightningDataModule):
            raise TypeError(
                f"`add`'s second argument is the datamodule, and got a {type(datamodule).__name__}. Pass loaders by "
                "name: `add(model, train_dataloaders=..., val_dataloaders=...)`."
            )
        if any(member.model is model for member in self._members):
            raise ValueError(
                f"This `{type(model).__name__}` instance is in the sweep already: each model trains its own "
                "parameters, so add a new instance (e.g. `copy.deepcopy(model)`) for another run of it."
            )
        name = name or f"{len(self._members)}:{type(model).__name__}"
        if any(member.name == name for member in self._members):
            raise ValueError(f"A model named {name!r} is in the sweep already; give each a different `name`.")
        spill_dir = None if self.spill_dir is None else Path(self.spill_dir) / f"model{len(self._members)}"
        if spill_dir is not None:
            spill_dir.mkdir(parents=True, exist_ok=True)
        member = SweepMember(
            name,
            model,
            dict(
                datamodule=datamodule,
                train_dataloaders=train_dataloaders,
                val_dataloaders=val_dataloaders,
                ckpt_path=ckpt_path,
            ),
            next_decision=next_decision,
            random_state=generator_states(self.scheduler.generator_device),
        )
        spilling: dict[str, Any] = dict(
            memory_budget=self.memory_budget,
            spill_dir=spill_dir,
            prefetch=self.prefetch,
            storage_options=self.storage_options,
        )
        if self.processes:  # alone in a worker process
            strategy: SpillingStrategy = WorkerStrategy(member, **spilling)
            progress: pl.Callback = WorkerCallback(member)
        else:
            strategy = SweepMemberStrategy(self.scheduler, member, **spilling)
            progress = SweepMemberCallback(self.scheduler, member, lambda: self._display)
        strategy.seed_data_order_now()  # as `seed_everything` set it for this model, built and added alone
        trainer_kwargs.setdefault("enable_progress_bar", False)
        trainer_kwargs.setdefault("enable_model_summary", False)
        callbacks = list(trainer_kwargs.pop("callbacks", None) or [])
        with _quiet_lightning_info():
            trainer = pl.Trainer(
                accelerator="gpu" if self.on_gpu else "cpu",
                devices=[self.scheduler.gpus[0].index] if self.scheduler.gpus else 1,
                strategy=strategy,
                callbacks=[*callbacks, progress],
                **trainer_kwargs,
            )
        if not self.processes:  # each worker process has a default dtype of its own
            _refuse_another_default_dtype(trainer, [m.trainer for m in self._members])
        _claim_log_dirs(trainer)
        member.trainer = trainer
        self._members.append(member)
        self.scheduler.add(name, sum(p.numel() * p.element_size() for p in model.parameters()), member.random_state)
        return trainer

    def fit(self) -> list[pl.Trainer]:
        """Fit every model added; returns their Trainers in the order added. A model whose fit raised does not stop
        the others: `results` (and a warning) say which failed and why."""
        if not self._members:
            raise ValueError("No model to fit: call `add(model, ...)` first.")
        if self.results:
            raise RuntimeError(
                "This sweep has been fitted: `fit` runs once. To train on, make a new MultiModelTrainer and add "
                "each model with `ckpt_path=` its last checkpoint."
            )
        if len(self._members) < self.devices:
            rank_zero_info(
                f"MultiModelTrainer: {len(self._members)} model(s) for {self.devices} devices; "
                f"{self.devices - len(self._members)} device(s) will stay idle, since a model's shards run one at a "
                "time. Add models, or use fewer devices."
            )
        if self.keep_on_device is None:
            stays = self._staying_on_the_gpu()
        else:
            stays = [self.keep_on_device] * len(self._members)
        for member, member_stays in zip(self._members, stays):
            member.stays_on_device = member_stays
        self.results = [ModelResult(m.name, m.trainer) for m in self._members]
        self._display = SweepDisplay([m.name for m in self._members]) if self.enable_progress_bar else None
        if self.processes:
            with self._display.logs_above() if self._display is not None else nullcontext():
                fit_in_processes(self._members, self.results, self.devices, self._display, self.scheduler.spans)
            return self._summarize()
        if not torch.cuda.is_available():
            register_cuda_device_guard()  # before the models' threads trace (see the function)
        threads = [
            threading.Thread(target=self._fit_shown, args=(m, r), name=f"sweep {m.name}", daemon=True)
            for m, r in zip(self._members, self.results)
        ]
        with (
            torch_threads(1) if not self.on_gpu else nullcontext(),
            # The steps' contexts, crossing in the models' threads, then each restore the dtype they all set.
            default_dtype(_step_default_dtype(self._members[0].trainer)),
            stopped_by_signals(self.scheduler),
            self._display.logs_above() if self._display is not None else nullcontext(),
        ):
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
        return self._summarize()

    def _summarize(self) -> list[pl.Trainer]:
        """Close the display, log the summary and warn of the models that failed; the Trainers, in the order added."""
        if self._display is not None:
            self._display.close()
        rank_zero_info(f"MultiModelTrainer summary:\n{summary_table(self.results)}")
        failed = [r for r in self.results if r.status == "failed"]
        if failed:
            rank_zero_warn(
                "MultiModelTrainer: "
                + "; ".join(f"{r.name} failed: {type(r.error).__name__}: {r.error}" for r in failed)
            )
        return [m.trainer for m in self._members]

    def optimize(
        self,
        study: optuna.Study,
        build: Callable[[optuna.trial.Trial], dict[str, Any]],
        n_trials: int,
        monitor: str,
        *,
        value: Literal["last", "best"] = "last",
        max_running: int | None = None,
        checkpoint_interval: float = 300.0,
        heartbeat_interval: float = 10.0,
        grace_period: float = 120.0,
    ) -> list[TrialOutcome]:
        """Run the Optuna ``study`` as one sweep until it holds ``n_trials`` trials (see `StudyRunner`).

        ``build(trial)`` suggests a trial's parameters and returns what `add` takes for it (``model`` and the rest
        by name, ``max_steps``, ``callbacks``, a logger...). Up to ``max_running`` trials train at once (default:
        one per device; more take turns on the devices, which helps trials that spill, but lets the pruner decide
        with fewer trials at each rung, so that more of them go on; fewer while host memory would not hold another
        trial as large as the largest measured); each trial reports ``monitor`` after
        every validation, ends at its next step boundary when the study's pruner prunes it, and its value is its
        ``"last"`` or ``"best"`` ``monitor``. SIGTERM, SIGUSR1 or Ctrl-C stop every running trial at its next step
        boundary with a checkpoint under ``checkpoint_dir``, which the next run resumes; several workers (processes,
        machines) share one storage, and take over the trials of a worker that stops saying it runs (after
        ``grace_period`` seconds) from their last checkpoint (taken every ``checkpoint_interval`` seconds). Returns
        how the trials this worker ran ended.
        """
        if self._members:
            raise ValueError("`optimize` runs a study in an empty sweep: make a MultiModelTrainer for it alone.")
        if self.checkpoint_dir is None:
            raise ValueError(
                "`optimize` checkpoints every trial so that a preempted or killed worker loses none: pass "
                "`MultiModelTrainer(checkpoint_dir=...)` (a folder or fsspec URL the workers of the study share)."
            )
        if len(study.directions) != 1:
            objectives = len(study.directions)
            raise ValueError(f"`optimize` runs a study of one objective (`monitor={monitor!r}`), not {objectives}.")
        if value not in ("last", "best"):
            raise ValueError(f'`value={value!r}`: a trial\'s value is its "last" or "best" `{monitor}`.')
        Storage(self.storage_options).check_writable(self.checkpoint_dir)  # not first at a preemption's checkpoint
        if self.processes:  # a one-device sweep per process, each a worker of the study
            each = max(1, (max_running or self.devices) // self.devices)

            def worker(lent: LentCores | None) -> list[TrialOutcome]:  # in its process, pinned to its core
                return self._one_device_sweep(lent).optimize(
                    study, build, n_trials, monitor, value=value, max_running=each,
                    checkpoint_interval=checkpoint_interval, heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period,
                )  # fmt: skip

            rows = each * self.devices if self.enable_progress_bar else 0
            return optimize_in_processes(study, self.devices, worker, monitor, rows, self.scheduler.pin)
        preempted = threading.Event()
        max_running = max_running or self.devices
        display = self._display = StudyDisplay(max_running, study.study_name) if self.enable_progress_bar else None
        runner = StudyRunner(
            self, study, build, n_trials, monitor, value, self.checkpoint_dir, checkpoint_interval,
            heartbeat_interval, grace_period, max_running, preempted, display,
            self.scheduler.lent.set_idle if self.scheduler.lent is not None else None,
        )  # fmt: skip
        if not torch.cuda.is_available():
            register_cuda_device_guard()
        with (
            torch_threads(1) if not self.on_gpu else nullcontext(),
            default_dtype(torch.get_default_dtype()),  # as it was, after the trials' (`launch`)
            preempted_by_signals(preempted, self.scheduler),
            self._display.logs_above() if self._display is not None else nullcontext(),
        ):
            outcomes = runner.run()
        if self._display is not None:
            self._display.close()
        return outcomes

    def _one_device_sweep(self, lent: LentCores | None) -> MultiModelTrainer:
        """A sweep like this one on one device (this process's first core, and the cores ``lent`` to it; wherever
        the OS puts its threads if this sweep's are not pinned), in threads, without a display."""
        sweep = MultiModelTrainer(
            devices=1, memory_budget=self.memory_budget, spill_dir=self.spill_dir, prefetch=self.prefetch,
            storage_options=self.storage_options, enable_progress_bar=False, keep_on_device=self.keep_on_device,
            checkpoint_dir=self.checkpoint_dir, ranking=self.scheduler.ranking,
        )  # fmt: skip
        sweep.scheduler.pin, sweep.scheduler.lent = self.scheduler.pin, lent
        return sweep

    def launch(self, trainer: pl.Trainer, ended: Callable[[ModelResult], None]) -> ModelResult:
        """Start fitting the model added with ``trainer`` (alongside those training); ``ended(result)`` runs in its
        thread once its fit has ended."""
        member = next(m for m in self._members if m.trainer is trainer)
        member.stays_on_device = self.keep_on_device if self.keep_on_device is not None else self._host_is_device()
        result = ModelResult(member.name, trainer)

        def fit() -> None:
            self._fit_member(member, result)
            ended(result)

        # The process's default dtype, which the models' steps set (and each restores) in their threads: the same
        # for every model of the sweep (`add` refuses another), set once here; `optimize` restores it after.
        torch.set_default_dtype(_step_default_dtype(trainer))

        threading.Thread(target=fit, name=f"sweep {member.name}", daemon=True).start()
        return result

    def building(self) -> AbstractContextManager[None]:
        """While the block builds a model (a study's trial, while others train), no model of the sweep draws from
        torch's global generator or restores its state."""
        return self.scheduler.generator_held("building a model")

    def measured_bytes(self, trainer: pl.Trainer) -> int:
        """What the model of ``trainer`` was measured to need (parameters, gradients, optimizer state and the
        activations a step keeps; its parameters alone until its set-up has measured it)."""
        member = next(m for m in self._members if m.trainer is trainer)
        return self.scheduler.clock(member.name).size

    def forget(self, trainer: pl.Trainer) -> None:
        """Drop the model of ``trainer`` from the sweep (its fit has ended), so that it can be freed."""
        self._members = [m for m in self._members if m.trainer is not trainer]

    def _staying_on_the_gpu(self) -> list[bool]:
        """Which models stay on the GPU between their turns: those that save the most copies (`staying_models`),
        their parameters, gradients and optimizer state within half of what the GPU has free (the rest for a turn's
        activations). On the CPU, every model if they wait in host memory (spilling them there frees nothing)."""
        if self.scheduler.gpus is None:
            return [self._host_is_device()] * len(self._members)
        free = torch.cuda.mem_get_info(self.scheduler.gpus[0])[0]
        sizes = [sum(4 * p.numel() * p.element_size() for p in m.model.parameters()) for m in self._members]
        steps = [m.trainer.max_steps if m.trainer.max_steps > 0 else float("inf") for m in self._members]
        stays = staying_models(sizes, steps, free // 2)
        rank_zero_info(
            f"MultiModelTrainer: {sum(stays)} of {len(stays)} model(s) stay on the GPU between their turns (their "
            f"state, {format_bytes(sum(s for s, kept in zip(sizes, stays) if kept))}, within half of the "
            f"{format_bytes(free)} free)."
        )
        return stays

    def _host_is_device(self) -> bool:
        """Whether spilling a model saves no device memory: on the CPU, in host memory (no ``spill_dir``)."""
        return self.scheduler.gpus is None and self.spill_dir is None

    @property
    def spans(self) -> list[DeviceSpan]:
        """Every shard turn so far: which model ran what on which device, and when."""
        return list(self.scheduler.spans)

    @property
    def gpu_spans(self) -> list[DeviceSpan]:
        """On a GPU: when each turn of `spans` ran on the GPU (CUDA events; `spans` are the host's time issuing
        them). Empty on the CPU."""
        return self.scheduler.gpu_spans()

    def write_trace(self, path: str | Path) -> None:
        """Write the devices' timeline as a Chrome / Perfetto trace (one row per device, coloured by model; on a GPU,
        a row for the host issuing the turns and one for the GPU running them)."""
        metadata = {"models": [m.name for m in self._members]}
        Path(path).write_text(device_timeline_trace(self.spans, metadata, self.gpu_spans))

    def _fit_member(self, member: SweepMember, result: ModelResult) -> None:
        if not self.on_gpu:
            torch.set_num_threads(1)
        start = time.perf_counter()
        try:
            member.trainer.fit(member.model, **member.fit_kwargs)
            result.status = "finished"
        except SweepStopped as stopped:
            result.status, result.error = "stopped", stopped
        except BaseException as error:  # noqa: BLE001 - one model's failure must not end the sweep
            result.status, result.error = "failed", error
        finally:
            self.scheduler.finished(member.name)
            result.seconds = time.perf_counter() - start
            result.device_s = self.scheduler.clock(member.name).device_s
            if member.steps_before is not None:  # training started: the steps of this sweep, a failed one's too
                result.steps = member.trainer.global_step - member.steps_before
            result.final_loss = member.last_loss

    def _fit_shown(self, member: SweepMember, result: ModelResult) -> None:
        """`_fit_member`, then its bar says how it ended (in a study, the runner says it: pruned, failed...)."""
        self._fit_member(member, result)
        if self._display is not None:
            early = result.status == "finished" and member.trainer.should_stop  # a callback ended it
            self._display.ended(member.name, "stopped early" if early else result.status)


def _step_default_dtype(trainer: pl.Trainer) -> torch.dtype:
    """torch's default dtype while ``trainer``'s steps run: its precision's ("64-true", "bf16-true"), or float32."""
    with trainer.precision_plugin.forward_context():
        return torch.get_default_dtype()


def _refuse_another_default_dtype(trainer: pl.Trainer, others: list[pl.Trainer]) -> None:
    """The models of a sweep step at once in threads of one process, which has one default dtype."""
    if not others:
        return
    dtype, theirs = _step_default_dtype(trainer), _step_default_dtype(others[0])
    if dtype != theirs:
        raise ValueError(
            f"`precision={trainer.precision!r}` steps with torch's default dtype {dtype}, and the models added before "
            f"with {theirs} (`precision={others[0].precision!r}`). A process has one default dtype, and the models "
            "of a sweep train at once in one process: put models of the 'true' precisions (which set it) in a sweep "
            "of their own."
        )


@contextmanager
def _quiet_lightning_info() -> Iterator[None]:
    """Lightning's start-up lines ("GPU available: ...") once, not once per model."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _claim_log_dirs(trainer: pl.Trainer) -> None:
    """Create each local logger's folder now, so that the next model's default logger takes the next version."""
    for logger in trainer.loggers:
        log_dir = logger.log_dir
        if log_dir is not None and "://" not in str(log_dir):
            os.makedirs(log_dir, exist_ok=True)
