"""``ckpt_path="last"`` resumes from the newest *complete* checkpoint, on any fsspec URL.

Lightning resolves ``"last"`` to the newest ``last*.ckpt`` file it lists in each ModelCheckpoint's folder by
modification time; that neither sees folders on object stores nor skips a save that was interrupted. With
VarunaStrategy and SpillingStrategy, ``"last"`` means the most recently committed checkpoint (any name) in the
folders of the trainer's checkpoint callbacks (ModelCheckpoint, where it writes without a ``dirpath`` too, and
MorphCallback), or a newer single-file ``last*.ckpt`` there (a run's before it used these strategies); interrupted
saves are skipped with a warning; with none, training starts fresh with a log line saying so.

Under SLURM with Lightning's auto-requeue (its default there), Lightning saves a checkpoint inside the requeue
signal's handler, wherever the step is: in a pipelined step that can be between two micro-batches, where the
stages hold different steps' states and a stage waiting for a message in the schedule never reaches the save.
In a spilled step it can be between two shards, some stepped and some not. The launcher therefore gives that
signal to a `MorphCallback` (the trainer's own that handles it, else one writing to
``<default_root_dir>/hpc_checkpoints/<job id>``), which saves at an optimizer step and then requeues the job (in the
main thread: elsewhere, as in a `MultiModelTrainer`'s threads, neither can handle a signal); and
``fit(ckpt_path=None)`` in a requeued job means ``"last"``, as Lightning resumes a requeued job from its checkpoint.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_varuna._lightning_private import (
    CheckpointConnector,
    LauncherBase,
    MultiProcessingLauncherBase,
    SubprocessScriptLauncherBase,
    disable_module_memory_sharing,
    resolve_checkpoint_dir,
)
from lightning_varuna.callbacks.morph import MorphCallback
from lightning_varuna.checkpoint.layout import SET_ASIDE, find_newest
from lightning_varuna.slurm import is_requeued_job, job_id, requeue_signal
from lightning_varuna.storage import join
from lightning_varuna.strategies.failures import ReportFirstFailure

if TYPE_CHECKING:
    from lightning_varuna.storage import Storage

__all__ = [
    "InProcessLauncher",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "add_requeue_callback",
    "checkpoint_folders",
    "newest_complete_checkpoint",
]


def checkpoint_folders(trainer: pl.Trainer) -> list[str]:
    """The folders that the trainer's checkpoint callbacks (ModelCheckpoint, MorphCallback) write to."""
    folders = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelCheckpoint):
            folders.append(str(resolve_checkpoint_dir(callback, trainer)))
        elif isinstance(callback, MorphCallback):
            folders.append(str(callback.dirpath))
    return list(dict.fromkeys(folders))


def newest_complete_checkpoint(storage: Storage, folders: list[str]) -> str | None:
    """The URL of the most recently committed checkpoint in ``folders``, or of a newer single-file ``last*.ckpt``
    there (Lightning's, from a run without these strategies); warn about interrupted saves."""
    info, incomplete = find_newest(storage, folders)
    if incomplete:
        rank_zero_warn(f"Skipping interrupted checkpoint saves (no commit marker): {incomplete}")
    single_file = _newest_last_file(storage, folders, set_aside=info is None)
    if single_file is not None and (info is None or single_file[1] > info.saved_at):
        rank_zero_info(f'ckpt_path="last": resuming from the single-file checkpoint {single_file[0]}.')
        return single_file[0]
    if info is None:
        rank_zero_info(f'ckpt_path="last": no complete checkpoint in {folders}; training starts from scratch.')
        return None
    rank_zero_info(
        f'ckpt_path="last": resuming from {info.url} (epoch {info.epoch}, global step {info.global_step}, written '
        f"with pipeline x data parallel {info.shape.get('pipeline_parallel_size')} x "
        f"{info.shape.get('data_parallel_size')})."
    )
    return info.url


def _newest_last_file(storage: Storage, folders: list[str], set_aside: bool) -> tuple[str, float] | None:
    """The newest file named as Lightning names its "last" checkpoints (``last.ckpt``, ``last-v1.ckpt``) in
    ``folders``, and when it was written; with ``set_aside``, one that a save which never committed set aside too (its
    time is that of its move on an object store, so it only counts where no save committed)."""
    endings = (".ckpt", ".ckpt" + SET_ASIDE) if set_aside else (".ckpt",)
    found = []
    for folder in folders:
        for name in storage.children(folder):
            if not (name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST) and name.endswith(endings)):
                continue
            fs, path = storage.fs(join(folder, name))
            if fs.isfile(path):
                found.append((join(folder, name), fs.modified(path).timestamp()))
    return max(found, key=lambda item: item[1], default=None)


def add_requeue_callback(trainer: pl.Trainer) -> None:
    """Under SLURM auto-requeue, have a `MorphCallback` handle the requeue signal (see above)."""
    if threading.current_thread() is not threading.main_thread():
        return  # no signal handler here: Lightning installs none either
    signum = requeue_signal(trainer)
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    if signum is None or any(isinstance(cb, MorphCallback) and signum in cb.signals for cb in callbacks):
        return
    dirpath = join(str(trainer.default_root_dir), "hpc_checkpoints", job_id())
    callbacks.append(MorphCallback(dirpath, signal=signum))


class _VarunaCheckpointConnector(CheckpointConnector):
    def _parse_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        requeued = is_requeued_job() and requeue_signal(self.trainer) is not None
        if ckpt_path == "last" or (ckpt_path is None and state_fn == TrainerFn.FITTING and requeued):
            folders = checkpoint_folders(self.trainer)  # only now: it asks the logger for its folder
            if folders:
                storage = self.trainer.strategy.checkpoint_storage  # type: ignore[attr-defined]
                return newest_complete_checkpoint(storage, folders)
        return super()._parse_ckpt_path(state_fn, ckpt_path, model_provided, model_connected)


class _ResolvesLast:
    """Launcher mixin: in every process, the trainer resolves ``ckpt_path="last"`` as described above.

    Lightning resolves ``ckpt_path`` in the launched function before any strategy hook runs; the launcher is
    the one place that sees the trainer first.
    """

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None and type(trainer._checkpoint_connector) is CheckpointConnector:
            trainer._checkpoint_connector.__class__ = _VarunaCheckpointConnector
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class _PrepareTrainer(_ResolvesLast):
    """Launcher mixin: the trainer resolves ``ckpt_path="last"`` and handles SLURM's requeue signal as described
    above."""

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            add_requeue_callback(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _RunsHere(LauncherBase):
    """Runs the trainer's function in the calling process, as Lightning does for a strategy without a launcher."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: no other process was started."""


class InProcessLauncher(_PrepareTrainer, _RunsHere):
    """For a strategy that trains in the calling process (SpillingStrategy), with the trainer prepared as described
    above."""


class SubprocessScriptLauncher(_PrepareTrainer, ReportFirstFailure, SubprocessScriptLauncherBase):
    """Lightning's launcher for ``devices=N`` / torchrun / SLURM, with the trainer prepared as described above; a
    failed job ends with the first failure's error (see `ReportFirstFailure`)."""


class MultiProcessingLauncher(_PrepareTrainer, MultiProcessingLauncherBase):
    """Lightning's spawn/fork/forkserver launcher, with the trainer prepared as described above. Under "forkserver" on
    the CPU each rank copies the model's tensors, as Lightning's does under "spawn": the model arrives in memory that
    every rank shares, and replicas (or the stages holding a tied weight) would all update that one copy."""

    def _wrapping_function(
        self, process_idx: int, trainer: Any, function: Any, args: Any, kwargs: Any, *rest: Any
    ) -> Any:
        on_cpu = isinstance(self._strategy.accelerator, pl.accelerators.CPUAccelerator)
        if self._start_method == "forkserver" and on_cpu:
            args, kwargs = disable_module_memory_sharing((args, kwargs))
        return super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
