"""Train the models of a sweep together (Hydra): each model is fitted by its own Lightning Trainer under
`SpillingStrategy` in its own thread, and its shards take turns on the sweep's devices, longest remaining time first
(`DeviceScheduler`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_varuna._torch_private import register_cuda_device_guard
from lightning_varuna.multimodel.report import (
    ModelResult,
    StudyDisplay,
    SweepDisplay,
    device_timeline_trace,
    summary_table,
)
from lightning_varuna.multimodel.scheduler import DeviceScheduler, DeviceSpan, SweepStopped
from lightning_varuna.multimodel.study import StudyRunner, TrialOutcome
from lightning_varuna.partition.packing import format_bytes
from lightning_varuna.pipeline.replay import default_dtype
from lightning_varuna.strategies.launchers import InProcessLauncher
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
            their parameters) fit in half of what the GPU has free as `fit` starts; never on the CPU, where host
            memory is the device's.
        checkpoint_dir: where `optimize` keeps each trial's checkpoint (any fsspec URL; the workers of one study
            share it).
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
    ) -> None:
        if accelerator not in ("cpu", "gpu", "cuda"):
            raise ValueError(f"MultiModelTrainer runs on 'cpu' or 'gpu' (CUDA), not accelerator={accelerator!r}.")
        if devices < 1:
            raise ValueError(f"`devices` must be at least 1, got {devices}.")
        self.on_gpu = accelerator != "cpu"
        if self.on_gpu:
            _check_one_gpu(devices)
        self.devices = devices
        self.memory_budget, self.spill_dir, self.prefetch = memory_budget, spill_dir, prefetch
        self.storage_options = storage_options
        self.enable_progress_bar, self.keep_on_device = enable_progress_bar, keep_on_device
        self.checkpoint_dir = str(checkpoint_dir) if checkpoint_dir is not None else None
        if self.on_gpu:
            self.scheduler = DeviceScheduler(devices, gpus=[torch.device("cuda", torch.cuda.current_device())])
        else:
            self.scheduler = DeviceScheduler(devices, cores=_cores_for(devices))
        self.results: list[ModelResult] = []
        self._members: list[_Member] = []
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
        **trainer_kwargs: Any,
    ) -> pl.Trainer:
        """Add ``model`` to the sweep, with what `Trainer(...)` (``trainer_kwargs``) and `Trainer.fit` take for it;
        ``name`` shows it in the progress display and the summary. Returns its Trainer."""
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
        member = _Member(
            name,
            model,
            dict(
                datamodule=datamodule,
                train_dataloaders=train_dataloaders,
                val_dataloaders=val_dataloaders,
                ckpt_path=ckpt_path,
            ),
        )
        strategy = _SweepMemberStrategy(
            self.scheduler,
            member,
            memory_budget=self.memory_budget,
            spill_dir=spill_dir,
            prefetch=self.prefetch,
            storage_options=self.storage_options,
        )
        trainer_kwargs.setdefault("enable_progress_bar", False)
        trainer_kwargs.setdefault("enable_model_summary", False)
        callbacks = list(trainer_kwargs.pop("callbacks", None) or [])
        with _quiet_lightning_info():
            trainer = pl.Trainer(
                accelerator="gpu" if self.on_gpu else "cpu",
                devices=[self.scheduler.gpus[0].index] if self.scheduler.gpus else 1,
                strategy=strategy,
                callbacks=[*callbacks, _SweepMemberCallback(self, member)],
                **trainer_kwargs,
            )
        _refuse_another_default_dtype(trainer, [m.trainer for m in self._members])
        _claim_log_dirs(trainer)
        member.trainer = trainer
        self._members.append(member)
        self.scheduler.add(name, sum(p.numel() * p.element_size() for p in model.parameters()))
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
        if not torch.cuda.is_available():
            register_cuda_device_guard()  # before the models' threads trace (see the function)
        threads = [
            threading.Thread(target=self._fit_member, args=(m, r), name=f"sweep {m.name}", daemon=True)
            for m, r in zip(self._members, self.results)
        ]
        with (
            _torch_threads(1) if not self.on_gpu else nullcontext(),
            # The steps' contexts, crossing in the models' threads, then each restore the dtype they all set.
            default_dtype(_step_default_dtype(self._members[0].trainer)),
            _stopped_by_signals(self.scheduler),
            self._display.logs_above() if self._display is not None else nullcontext(),
        ):
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
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
        twice the devices, fewer while host memory would not hold another); each trial reports ``monitor`` after
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
        preempted = threading.Event()
        rows = max_running or 2 * self.devices
        display = self._display = StudyDisplay(rows, study.study_name) if self.enable_progress_bar else None
        runner = StudyRunner(
            self, study, build, n_trials, monitor, value, self.checkpoint_dir, checkpoint_interval,
            heartbeat_interval, grace_period, max_running or 2 * self.devices, preempted, display,
        )  # fmt: skip
        if not torch.cuda.is_available():
            register_cuda_device_guard()
        with (
            _torch_threads(1) if not self.on_gpu else nullcontext(),
            default_dtype(torch.get_default_dtype()),  # as it was, after the trials' (`launch`)
            _preempted_by_signals(preempted, self.scheduler),
            self._display.logs_above() if self._display is not None else nullcontext(),
        ):
            outcomes = runner.run()
        if self._display is not None:
            self._display.close()
        return outcomes

    def launch(self, trainer: pl.Trainer, ended: Callable[[ModelResult], None]) -> ModelResult:
        """Start fitting the model added with ``trainer`` (alongside those training); ``ended(result)`` runs in its
        thread once its fit has ended."""
        member = next(m for m in self._members if m.trainer is trainer)
        member.stays_on_device = bool(self.keep_on_device)
        result = ModelResult(member.name, trainer)

        def fit() -> None:
            self._fit_member(member, result)
            ended(result)

        # The process's default dtype, which the models' steps set (and each restores) in their threads: the same
        # for every model of the sweep (`add` refuses another), set once here; `optimize` restores it after.
        torch.set_default_dtype(_step_default_dtype(trainer))

        threading.Thread(target=fit, name=f"sweep {member.name}", daemon=True).start()
        return result

    def forget(self, trainer: pl.Trainer) -> None:
        """Drop the model of ``trainer`` from the sweep (its fit has ended), so that it can be freed."""
        self._members = [m for m in self._members if m.trainer is not trainer]

    def _staying_on_the_gpu(self) -> list[bool]:
        """Which models stay on the GPU between their turns: those that save the most copies (`staying_models`),
        their parameters, gradients and optimizer state within half of what the GPU has free (the rest for a turn's
        activations). None on the CPU."""
        if self.scheduler.gpus is None:
            return [False] * len(self._members)
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

    def _fit_member(self, member: _Member, result: ModelResult) -> None:
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
            if self._display is not None:
                early = result.status == "finished" and member.trainer.should_stop  # a callback ended it
                self._display.ended(member.name, "stopped early" if early else result.status)


@dataclass
class _Member:
    name: str
    model: pl.LightningModule
    fit_kwargs: dict[str, Any]
    trainer: pl.Trainer = field(init=False)
    stays_on_device: bool = False  # if it fits its budget in one shard (`keep_on_device`, decided by `fit`)
    last_loss: float | None = None
    steps_before: int | None = None  # the global step at which this sweep's training started


class _SweepMemberStrategy(SpillingStrategy):
    """`SpillingStrategy` whose shards wait for the sweep's devices; its set-up (which runs the model to measure it)
    holds a device and torch's global generator, and it traces its forward while the other models wait."""

    def __init__(self, scheduler: DeviceScheduler, member: _Member, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scheduler, self.sweep_name, self._member = scheduler, member.name, member

    @override
    def _configure_launcher(self) -> None:
        self._launcher = _SweepMemberLauncher(self.scheduler)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        with self.scheduler.turn(self.sweep_name, "set-up", -1, generator=True):
            super().setup(trainer)
        clock = self.scheduler.clock(self.sweep_name)
        clock.size = sum(m.state_bytes + m.activation_bytes for m in self.segment_memory)
        if not self.forward_draws:  # measured holding the generator: none of its turns needs it, not even its first
            clock.draws.update({(i, self._module.training): False for i in range(len(self.shards))})

    @override
    def barrier(self, name: str | None = None) -> None:
        """Hold torch's global generator from the start of a fit's run (``"run-stage"``) until training starts:
        Lightning's sanity check restores the generator's state when it ends, outside any turn, which must not land
        in the middle of another model's forward."""
        super().barrier(name)
        if name == "run-stage" and self._module.trainer.state.fn == TrainerFn.FITTING:
            self.scheduler.hold_generator(self.sweep_name)

    @override
    def on_train_start(self) -> None:
        self.scheduler.release_generator(self.sweep_name)
        super().on_train_start()

    @override
    def teardown(self) -> None:
        self.scheduler.release_generator(self.sweep_name)
        super().teardown()

    @override
    def _tracing(self) -> AbstractContextManager[None]:
        return self.scheduler.alone(self.sweep_name)

    @override
    def _turn(self, work: str, shard: int) -> AbstractContextManager[bool]:
        return self.scheduler.turn(self.sweep_name, work, shard, training=self._module.training)

    @override
    def _keeps_whole_model(self) -> bool:
        return self._member.stays_on_device

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Each DataLoader draws its workers' base seed from a generator of its own, not from torch's global one
        while another model's dropout is using it."""
        dataloader = super().process_dataloader(dataloader)
        if isinstance(dataloader, DataLoader) and dataloader.generator is None:
            dataloader.generator = torch.Generator().manual_seed(int(os.getenv("PL_GLOBAL_SEED", 0)))
        return dataloader


class _SweepMemberLauncher(InProcessLauncher):
    """A KeyboardInterrupt raised in a model's step stops the sweep, as Ctrl-C does; that model's fit ends as on any
    error (Lightning's own handling of it would ignore SIGINT, which a model's thread may not, and skip the
    teardown that brings its spilled weights back)."""

    def __init__(self, scheduler: DeviceScheduler) -> None:
        self.scheduler = scheduler

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except KeyboardInterrupt as interrupt:
            self.scheduler.stop("KeyboardInterrupt")
            raise SweepStopped("the sweep was stopped (KeyboardInterrupt in this model's step)") from interrupt


class _SweepMemberCallback(pl.Callback):
    """Reports a model's progress to the scheduler (its remaining time) and to the sweep's display."""

    def __init__(self, sweep: MultiModelTrainer, member: _Member) -> None:
        self.sweep, self.member = sweep, member

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.member.steps_before = trainer.global_step
        self._report(trainer)
        if self.sweep._display is not None:
            self.sweep._display.started(self.member.name, trainer.estimated_stepping_batches, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            # Lightning hands on the loss divided by `accumulate_grad_batches` (what its backward ran on).
            accumulated = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self.member.last_loss = float(loss.detach()) * accumulated
        self._report(trainer)
        if self.sweep._display is not None:
            self.sweep._display.stepped(self.member.name, trainer.global_step, self.member.last_loss)

    def _report(self, trainer: pl.Trainer) -> None:
        steps_before = self.member.steps_before or 0
        self.sweep.scheduler.stepped(
            self.member.name,
            trainer.global_step - steps_before,
            float(trainer.estimated_stepping_batches),
            steps_before,
        )


def staying_models(sizes: list[int], steps: list[float], room: int) -> list[bool]:
    """Whether each model (its state's bytes, its steps: infinite if unknown) stays on the device within ``room``.

    A model that stays saves copying its state out and back every step: its bytes times its steps. Taken by steps,
    longest first (the larger first among equals, then in the order added), each model stays if it still fits beside
    those taken before it.
    """
    stays = [False] * len(sizes)
    taken = 0
    for i in sorted(range(len(sizes)), key=lambda i: (-steps[i], -sizes[i], i)):
        if taken + sizes[i] <= room:
            stays[i], taken = True, taken + sizes[i]
    return stays


def _check_one_gpu(devices: int) -> None:
    if not torch.cuda.is_available():
        raise ValueError(
            "MultiModelTrainer(accelerator='gpu') needs a CUDA GPU, and torch sees none. Use accelerator='cpu'."
        )
    if devices != 1:
        raise NotImplementedError(
            f"MultiModelTrainer trains a sweep on one GPU for now, not devices={devices}: run one sweep per GPU "
            "(each process seeing its own, `CUDA_VISIBLE_DEVICES=k`), or several on the CPU."
        )


def _cores_for(devices: int) -> list[int] | None:
    """A core of this process's for each device, if it has that many (and the OS lets threads be pinned)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores[:devices] if len(cores) >= devices else None


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
def _preempted_by_signals(preempted: threading.Event, scheduler: DeviceScheduler) -> Iterator[None]:
    """SIGTERM, SIGUSR1 (a preemption notice, as SLURM sends) and Ctrl-C set ``preempted``: every trial checkpoints at
    its next step boundary and ends. A second Ctrl-C stops the sweep at once (each trial keeps its last checkpoint)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def preempt(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and preempted.is_set():
            scheduler.stop("KeyboardInterrupt")
        preempted.set()

    for sig in signals:
        signal.signal(sig, preempt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _stopped_by_signals(scheduler: DeviceScheduler) -> Iterator[None]:
    """SIGTERM and Ctrl-C stop every model at its next shard boundary (each resumes from its last checkpoint)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def stop(signum: int, frame: Any) -> None:
        scheduler.stop(signal.Signals(signum).name)

    for sig in signals:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
