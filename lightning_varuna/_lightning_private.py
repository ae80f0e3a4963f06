"""The private Lightning APIs lightning-varuna relies on, all in one place (verified with lightning 2.6.6).

None has a public equivalent that does the same. If a Lightning release moves or changes one, this is the file to
change; the tests that exercise each are named below. Private attributes used on Lightning objects are listed too.
"""

from __future__ import annotations

# Re-making the training DataLoader around a resumable sampler with the user's other arguments (as Lightning's
# own distributed sampler injection does). tests/test_morph.py, tests/test_data_position.py.
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls as reinstantiate_dataloader

# Process-group set-up and helpers of Lightning's own DDP strategies. tests/test_parity.py.
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available

# Moving optimizer state to the device after a checkpoint is loaded. tests/test_checkpoint_resume.py.
from lightning.fabric.utilities.optimizer import _optimizer_to_device as optimizer_to_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

# The optimizers, schedulers and monitor in what `configure_optimizers` returns (any of its forms), to read a
# single-file checkpoint's optimizer state by parameter name. tests/test_real_models.py.
from lightning.pytorch.core.optimizer import _configure_optimizers as parse_configure_optimizers

# Lightning's process launchers, extended to resume `ckpt_path=None` in a requeued SLURM job and to end a failed job
# with the failing rank's error (whose `launch` repeats Lightning's, with `set_num_threads_if_needed` above).
# tests/test_morph.py, tests/test_failures.py.
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncherBase
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncherBase

# The base of a launcher that runs the trainer in the calling process (SpillingStrategy's), so that it resolves
# `ckpt_path="last"` as VarunaStrategy's launchers do. tests/test_checkpoint_storage.py.
from lightning.pytorch.strategies.launchers.launcher import _Launcher as LauncherBase

# Each rank's own copy of the model's tensors, as Lightning's launcher makes it under "spawn" on the CPU (the
# launcher's `_wrapping_function` is extended to make it under "forkserver" too).
# tests/test_parity.py::test_replicas_started_by_multiprocessing_train_like_one_device.
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing as disable_module_memory_sharing,
)

# Lightning's checkpoint connector, extended for `ckpt_path="last"` over sharded checkpoints, and the arguments a
# DataLoader was made with. tests/test_checkpoint_resume.py, tests/test_morph.py.
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector as CheckpointConnector
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs as dataloader_init_args

# The exception that ends a `fit` run by the tuner (`Tuner.lr_find`) normally, on every rank: not a failure.
# tests/test_lightning_integration.py.
from lightning.pytorch.utilities.exceptions import _TunerExitException as TunerExitException

# Private attributes and formats read or changed:
# - `LightningModule._compiler_ctx`, set by `Trainer.fit` for a module compiled whole (`torch.compile(model)`), which
#   SpillingStrategy refuses: strategies/spilling_requirements.py.
#   tests/test_spilling_refusals.py::test_a_model_compiled_whole_is_refused.
# - `trainer._checkpoint_connector` (its class is swapped for the extended connector): strategies/launchers.py.
# - `trainer._accelerator_connector.cluster_environment`, the environment whose SLURM auto-requeue Lightning's signal
#   handler reads, for the signal that asks a job to requeue: slurm.py. tests/test_morph.py.
# - `trainer._accelerator_connector.strategy` (what `Trainer.strategy` returns), set to the `SpillingStrategy` that
#   trains where VarunaStrategy's auto-configuration chose to spill: strategies/spilled_choice.py.
#   tests/test_auto_spilling.py, tests/test_morph.py.
# - `loop._data_source.dataloader()`: the first batch of the running loop, to trace the model at start-up, and
#   `LightningModule._on_before_batch_transfer`, through which the loop passes each batch: strategies/first_batch.py.
#   tests/test_spilling_precision.py::test_true_precisions_train_cut_like_one_device.
# - the checkpoint's `loops["fit_loop"]["epoch_progress"]` counters: `data.resumable.continue_unfinished_epoch`.
# - the precision plugin's `clip_grad_by_norm` / `clip_grad_by_value`, replaced on the instance:
#   strategies/clipping.py. tests/test_parity.py (gradient_clip_val), tests/test_spilling_like_one_device.py.
# - `trainer._signal_connector._sigterm_notifier_fn` (read when `Trainer._run` registers the signal handlers, after
#   the strategy's `setup`) and `trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor`, replaced on the instances
#   to drop Lightning's per-batch SIGTERM broadcast: strategies/sigterm.py.
#   tests/test_failures.py::test_sigterm_ends_ranks_that_wait_for_a_pipeline_message.
# - outside a run, `Trainer.callback_metrics`, `logged_metrics` and `progress_bar_metrics` return the dicts the
#   Trainer keeps, which a sweep updates with what a model's fit in a worker process left: multimodel/processes.py.
#   tests/test_multi_model_processes.py::test_each_model_in_a_worker_process_trains_as_if_alone.
# - `call._call_setup_hook` calls `strategy.barrier("pre_setup")` after `prepare_data` and before the `setup` hooks,
#   and the strategy's `on_train_start` comes after the sanity check (which runs inside `isolate_rng()`, restoring
#   torch's generator when it ends): a sweep's model holds the generator in between (multimodel/member.py).
#   tests/test_multi_model.py::test_models_with_dropout_train_as_alone_from_the_generator_state_they_were_added_in.
# - what a resumed fit draws from torch's generator before its first batch, which a sweep's model's generator state
#   relies on (multimodel/generator_checkpoint.py): passing over a validation that was due after the checkpoint's
#   batch (`_EvaluationLoop.increment_progress_to_evaluation_end`) starts its first DataLoader's iteration, drawing
#   its seed, as the uninterrupted fit's validation did; `_FitLoop.setup_data` starts the training DataLoaders'
#   iteration, and at an epoch's start the epoch loop may start it again.
#   tests/test_multi_model.py::test_a_model_with_dropout_resumed_from_its_checkpoint_continues_as_uninterrupted.
# - `TensorBoardLogger._log_graph` (whether `log_graph=True` was given and tensorboard is installed), read to refuse
#   a graph of a model no process holds whole: strategies/requirements.py.
#   tests/test_errors.py::test_a_graph_of_a_spilled_model_is_refused.

# The folder a ModelCheckpoint without a `dirpath` writes to (under the logger's folder or `default_root_dir`), as
# Lightning works it out: `resolve_checkpoint_dir(callback, trainer)`. tests/test_checkpoint_storage.py.
resolve_checkpoint_dir = ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir  # type: ignore[attr-defined]


def validates_as_scheduled(trainer: Trainer) -> bool:
    """Whether the fit validates after the training batch it is at (from its `on_train_batch_end`) as scheduled, not
    because `should_stop` is set: the epoch loop's `_should_check_val_fx`, asked with `should_stop` off.
    tests/test_model_selection.py::test_a_preempted_study_resumes_its_trials_on_the_next_run_exactly."""
    stop, trainer.should_stop = trainer.should_stop, False
    try:
        return trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)  # type: ignore[arg-type]
    finally:
        trainer.should_stop = stop


__all__ = [
    "CheckpointConnector",
    "disable_module_memory_sharing",
    "LauncherBase",
    "MultiProcessingLauncherBase",
    "SubprocessScriptLauncherBase",
    "TunerExitException",
    "dataloader_init_args",
    "default_process_group_backend",
    "distributed_is_initialized",
    "init_dist_connection",
    "optimizer_to_device",
    "optimizers_to_device",
    "parse_configure_optimizers",
    "reinstantiate_dataloader",
    "resolve_checkpoint_dir",
    "set_num_threads_if_needed",
    "sync_ddp_if_available",
    "validates_as_scheduled",
]
