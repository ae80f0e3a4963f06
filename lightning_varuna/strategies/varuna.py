"""`VarunaStrategy`: pipeline x data parallel training of a LightningModule cut at its CutPoints; Lightning's hooks
adapted to the package's pieces (`cut_model`, `StageSteps`, `GradientPhase`, `RunFailures`, `ShardedCheckpoints`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from functools import cache, partial
from typing import Any, Literal, TypeVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from torch import Tensor
from typing_extensions import override

from lightning_varuna._lightning_private import distributed_is_initialized, optimizer_to_device, optimizers_to_device
from lightning_varuna.checkpoint.consolidate import RUN_SHAPE
from lightning_varuna.checkpoint.layout import run_shape
from lightning_varuna.checkpoint.sharded import ShardedCheckpoints
from lightning_varuna.checkpoint.single_file import stage_checkpoint
from lightning_varuna.checkpoint.stage_save import split_stage_checkpoint
from lightning_varuna.checkpoint.state import load_optimizer_state_by_name, optimizer_state_by_name
from lightning_varuna.data.replicas import resumable_for_replicas
from lightning_varuna.partition.released import stage_state_dicts
from lightning_varuna.pipeline.gradients import GradientPhase
from lightning_varuna.pipeline.module_hooks import PipelinedModuleHooks
from lightning_varuna.pipeline.stage import Stage
from lightning_varuna.pipeline.stage_steps import StageSteps
from lightning_varuna.pipeline.topology import PipelineGroups, Topology
from lightning_varuna.pipeline.user_collectives import UserCollectives
from lightning_varuna.profiling.model_costs import ModelCosts
from lightning_varuna.profiling.simulator import Config
from lightning_varuna.profiling.spilled import SpilledConfig
from lightning_varuna.spilling.grad_scaler import shardwise
from lightning_varuna.strategies.callback_hooks import run_hook_inside
from lightning_varuna.strategies.clipping import route_gradient_clipping
from lightning_varuna.strategies.failures import RunFailures
from lightning_varuna.strategies.first_batch import first_batch_of_loaders
from lightning_varuna.strategies.model_cut import cut_model, default_micro_batch_size_of
from lightning_varuna.strategies.model_summary import summarize_whole_model
from lightning_varuna.strategies.optimizers import StageParameterGroups, torch_optimizer
from lightning_varuna.strategies.processes import MultiProcessStrategy
from lightning_varuna.strategies.requirements import require_pipelined_training
from lightning_varuna.strategies.resumable_training import ResumableTraining
from lightning_varuna.strategies.sigterm import stop_on_sigterm_without_broadcasts
from lightning_varuna.strategies.spilled_choice import train_spilled
from lightning_varuna.strategies.training_batches import TrainingBatches
from lightning_varuna.strategies.varuna_config import VarunaConfig

__all__ = ["VarunaStrategy"]

T = TypeVar("T")


class VarunaStrategy(ResumableTraining, MultiProcessStrategy):
    """Pipeline x data parallel training of a LightningModule cut at its `CutPoint`s (Varuna).

    The model is cut into ``pipeline_parallel_size`` stages at the cutpoints that balance the measured
    compute of the stages; each rank keeps only its stage's parameters. Every batch from the DataLoader is
    split into micro-batches of ``micro_batch_size`` that flow through the stages under ``schedule``;
    gradients are averaged over the ``data_parallel_size`` replicas. Training matches single-device
    training on the global batch (DataLoader batch x data_parallel_size).

    Args:
        pipeline_parallel_size: number of pipeline stages, or ``"auto"``: the fastest for the world size that the
            simulator predicts from ``profile`` (chosen again at every start, so an elastic job adapts).
        data_parallel_size: number of replicas of the pipeline; default: world size / pipeline_parallel_size.
        micro_batch_size: rows per micro-batch (a last micro-batch may be smaller), or ``"auto"`` (as above).
            Default: the replica's batch in 4 micro-batches per stage (a 1F1B bubble under 20%), the whole batch
            as one micro-batch with one stage; the choice is logged once.
        schedule: ``"1f1b"``, ``"gpipe"``, ``"varuna"`` (recompute each forward just before its backward),
            ``"zero-bubble"`` (ZB-H1: the parameters' gradients deferred to fill the bubble), ``"interleaved-1f1b"``
            (``stages_per_rank`` stages per rank: about 1 / V of 1F1B's bubble, for more messages), ``"zbv"`` (2 stages
            per rank in a V, zero-bubble), or ``"auto"``: the one the simulator predicts fastest with the other choices
            (needs ``profile``). See docs/pipelines.md.
        stages_per_rank: V of ``"interleaved-1f1b"`` (default 2, or chosen with ``"auto"`` sizes): the model is cut
            into ``pipeline_parallel_size`` x V stages, stage ``s`` on pipeline rank ``s % pipeline_parallel_size``.
        shared_weights: pairs of parameter names that must stay identical (Varuna's ``shared_weights``);
            the second is tied to the first. Parameters already tied (``head.weight = emb.weight``) are found
            on their own.
        profile_repeats: steps timed per segment to balance the stages.
        profile: a profile written by ``lightning-varuna profile`` (any fsspec URL): the stages are balanced with
            its timings instead of timing the segments at start-up, so the cut is the one the simulator assumed.
        global_batch_size: rows per optimizer step over all replicas. The training DataLoader is re-batched to
            ``global_batch_size / data_parallel_size`` rows per replica, so a job that restarts at another world
            size trains the same model. Default: DataLoader batch x data_parallel_size.
        loss_items: the number of items the loss of a batch is the mean of, as a function of the batch (default:
            its rows). Micro-batches are weighted by it, in the gradients and in the values logged, so that a loss
            that is a mean over tokens, some of them ignored, trains and logs the global batch's mean as one device
            does: ``loss_items=lambda batch: (batch["labels"] != -100).sum()``, and for a causal LM, whose loss is
            over each next token, ``batch["labels"][:, 1:]``. (With rows, each micro-batch's own token mean would
            count by its rows.)
        checkpoint_tempdir: a fast local folder: a checkpoint save writes there and training continues while a
            background thread uploads it to its URL (Varuna's ``tempdir``). Default: write to the URL directly.
        storage_options: fsspec options (credentials, ``endpoint_url``...) for every checkpoint URL.
        memory_budget: what one device may hold (bytes, a size such as ``"2GiB"``, or ``"50%"`` of its memory),
            with ``pipeline_parallel_size="auto"``: configurations that do not fit it are not chosen, and on one
            process the model may train spilled within it (`SpillingStrategy`), where the simulator predicts that
            fastest or nothing else fits (``trainer.strategy`` is then a `SpillingStrategy`; see docs/autoconfig.md).
        spill_dir: a folder to spill to if the choice is spilled (the disk tier becomes a candidate); default: host
            memory only.

    Under ``torchrun`` the number of processes per node and of nodes come from torchrun, whatever the Trainer's
    ``devices`` and ``num_nodes`` say, so one script runs at every size of an elastic job; the data-parallel
    size follows the world size. A checkpoint remembers how far into the epoch training got, and a resumed
    run continues from that sample at any world size.
    """

    strategy_name = "varuna"

    def __init__(
        self,
        pipeline_parallel_size: int | Literal["auto"] = 1,
        data_parallel_size: int | None = None,
        micro_batch_size: int | Literal["auto"] | None = None,
        schedule: str | Literal["auto"] = "1f1b",
        stages_per_rank: int | None = None,
        shared_weights: list[tuple[str, str]] | None = None,
        profile_repeats: int = 3,
        profile: str | None = None,
        global_batch_size: int | None = None,
        loss_items: Callable[[Any], int | Tensor] | None = None,
        checkpoint_tempdir: str | None = None,
        storage_options: dict[str, Any] | None = None,
        memory_budget: int | float | str | None = None,
        spill_dir: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self._config = VarunaConfig(
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            micro_batch_size=micro_batch_size,
            schedule=schedule,
            stages_per_rank=stages_per_rank,
            shared_weights=shared_weights,
            profile_repeats=profile_repeats,
            profile=profile,
            global_batch_size=global_batch_size,
            loss_items=loss_items,
            memory_budget=memory_budget,
            spill_dir=spill_dir,
            checkpoint_tempdir=checkpoint_tempdir,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            storage_options=storage_options,
            check_world_size=self._config.check_world_size,
        )
        self.chosen: Config | SpilledConfig | None = None  # what the auto-configuration chose, at set-up
        # 0 until chosen: by the auto-configuration ("auto") or from the first batch (None, see `setup`).
        self.pipeline_parallel_size: int = pipeline_parallel_size if isinstance(pipeline_parallel_size, int) else 0
        self.micro_batch_size: int = micro_batch_size if isinstance(micro_batch_size, int) else 0
        self._micro_batch_size_chosen_for: TrainerFn | None = None  # the run whose batch chose the default
        self.data_parallel_size, self.schedule, self.global_batch_size = data_parallel_size, schedule, global_batch_size
        self.shared_weights, self.loss_items = self._config.shared_weights or [], loss_items
        self.topology: Topology | None = None
        self._groups = PipelineGroups(None, None, (None, None))
        self._stages: Stage | None = None
        self._steps: StageSteps | None = None  # the steps on this rank's stage (`_stages`)
        self._gradients: GradientPhase | None = None
        self._module_hooks: PipelinedModuleHooks | None = None
        self._failures: RunFailures | None = None  # of the current Trainer run
        self._costs = ModelCosts(profile, self.checkpoint_storage, profile_repeats)
        self._checkpoints = ShardedCheckpoints(self.checkpoint_storage, tempdir=checkpoint_tempdir)
        self._batches = TrainingBatches(loss_items)
        self._parameter_groups = StageParameterGroups()

    # ----------------------------------------------------------------------------------------- processes
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of a replica read the same batches; replicas read disjoint ones.
        topology = _set_up(self.topology)
        return {"num_replicas": topology.data_parallel_size, "rank": topology.dp_rank}

    @override
    def setup_environment(self) -> None:
        """Start the processes' default process group (`MultiProcessStrategy`), then lay out the job's pipelines; or,
        where the auto-configuration chose to spill, hand the Trainer to a `ChosenSpilling` (`train_spilled`)."""
        super().setup_environment()
        if self._config.auto:  # what was left "auto", chosen for this world size
            sizes = (self.pipeline_parallel_size, self.micro_batch_size, self.schedule, self.root_device)
            keep = self._config.sizes_to_keep(*sizes)
            best = self.chosen = self._costs.choose_config(self.world_size, self.root_device, self.num_nodes, **keep)
            if isinstance(best, SpilledConfig):  # the Trainer trains spilled from here on
                train_spilled(self, best, self._config)
                return
            self.pipeline_parallel_size, self.micro_batch_size = best.pipeline_parallel_size, best.micro_batch_size
            self.schedule = best.schedule
        shape = self._config.layout_of(self.chosen, self.schedule, self.pipeline_parallel_size, self.data_parallel_size)
        self.topology = Topology.from_world(self.world_size, self.global_rank, *shape)
        self._config.check_global_batch_splits(
            self.topology.data_parallel_size, self.world_size, self.pipeline_parallel_size
        )
        self._groups = self.topology.process_groups()
        self._collectives = UserCollectives(self.topology, self._groups)

    # ---------------------------------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training DataLoader resumable mid-epoch and, with ``global_batch_size``, re-batch it."""
        if self._module.trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        replicas = _set_up(self.topology).data_parallel_size
        return resumable_for_replicas(dataloader, self._data, replicas, self.global_batch_size)

    # -------------------------------------------------------------------------------------- partitioning
    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        with self._released_slots_filled(self.root_device):
            self.model.to(self.root_device)

    def _released_slots_filled(self, device: torch.device) -> AbstractContextManager[None]:
        stages = self._stages  # (after a fit)
        return nullcontext() if stages is None or self.model is None else stages.released_slots_filled(device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._failures = failures = RunFailures(trainer, self.global_rank, self.topology)
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        topology = _set_up(self.topology)
        require_pipelined_training(trainer, "VarunaStrategy", topology.pipeline_parallel_size)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        stage = self._stage_of_this_model(trainer, topology)
        summarize_whole_model(trainer, stage.skeleton)
        if topology.pipeline_parallel_size > 1:
            steps = _set_up(self._steps)
            self._module_hooks = PipelinedModuleHooks(
                self._module,
                topology.is_last_stage,
                lambda: self._collectives.over_last_stages(self._module),
                lambda results: steps.results.exchange(results, failures.stop_if_job_ended),
                self._collectives.gather_from_stages,
            )
        # Finetuning callbacks add parameter groups as training goes, as `configure_optimizers` makes them.
        run_hook_inside(trainer, BaseFinetuning, "on_train_epoch_start", lambda _: self._whole_model_for_optimizers())
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        scaler = getattr(self.precision_plugin, "scaler", None)
        loss_scaler = shardwise(scaler) if scaler is not None else None
        gradients = self._gradients = GradientPhase(
            stage, topology, self._groups, self.root_device, failures.stop_if_job_ended, loss_scaler
        )
        route_gradient_clipping(self.precision_plugin, lambda _, clip_val: gradients.clip_by_global_norm(clip_val))
        if stage.runtime.waiter.polls:
            stop_on_sigterm_without_broadcasts(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _stage_of_this_model(self, trainer: pl.Trainer, topology: Topology) -> Stage:
        """This rank's stage, cut again for another model (`cut_model`) after choosing the default micro-batch size,
        which sets the shapes it is traced with."""
        chosen_for_another_run = self._micro_batch_size_chosen_for not in (None, TrainerFn.FITTING)  # e.g. `validate`
        first = cache(partial(first_batch_of_loaders, trainer))  # read once: it may start the loader's workers
        if not self.micro_batch_size or (trainer.state.fn == TrainerFn.FITTING and chosen_for_another_run):
            self.micro_batch_size = default_micro_batch_size_of(trainer, first, topology, self.global_batch_size)
            self._micro_batch_size_chosen_for = trainer.state.fn
        if self._stages is None or self._stages.module is not self.model:
            with self.precision_plugin.tensor_init_context():  # as in the steps: the forward's new tensors ("true")
                self._stages = cut_model(
                    trainer, first, topology, self._groups, self._costs, self.micro_batch_size, self.shared_weights
                )
            self._steps = StageSteps(
                self._module, self._stages, topology, self._groups, self.root_device, self.loss_items
            )
        if trainer.state.fn == TrainerFn.FITTING:  # the batch set-up read, if it read one (a refit may not)
            self._batches.fit_started(first().batch if first.cache_info().currsize else None)
        return self._stages

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """`configure_optimizers` sees the whole model, then each group keeps this stage's parameters, maybe none
        (`StageParameterGroups`)."""
        with self._whole_model_for_optimizers():
            super().setup_optimizers(trainer)

    def _whole_model_for_optimizers(self) -> AbstractContextManager[None]:
        return self._parameter_groups.whole_model(self._module, _set_up(self._stages).skeleton, lambda: self.optimizers)

    # ------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        topo, trainer = _set_up(self.topology), self._module.trainer
        rows = self._batches.check(args[0], self.micro_batch_size, topo, self._groups.stages, self.root_device, trainer)
        self._data.advance(rows * topo.data_parallel_size, trainer)
        with _set_up(self._gradients).computing(), self.precision_plugin.train_step_context():
            return self._pipelined_step("training_step", args, kwargs, backward=True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._pipelined_step("validation_step", args, kwargs, backward=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._pipelined_step("test_step", args, kwargs, backward=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._pipelined_step("predict_step", args, kwargs, backward=False)

    def _pipelined_step(self, step_name: str, args: tuple, kwargs: dict, backward: bool) -> Any:
        """Run ``step_name`` of every micro-batch through the pipeline; return the batch's step output."""
        schedule, scaler = (self.schedule, getattr(self.precision_plugin, "scaler", None)) if backward else (None, None)
        steps, failures = _set_up(self._steps), _set_up(self._failures)
        return steps.run(step_name, args, kwargs, self.micro_batch_size, schedule, scaler, failures)

    def record_timeline(self) -> None:
        """Record when each action of the coming training steps runs on this rank (see `PipelineTrace`)."""
        _set_up(self._stages).runtime.timeline = []

    def take_timeline(self) -> list[tuple[str, float, float]]:
        """Stop recording; return this rank's ``(action, start, end)`` in wall-clock seconds."""
        return _set_up(self._stages).runtime.take_timeline()

    # ------------------------------------------------------------------------------------------ gradients
    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's hook for the batches that accumulate gradients without an optimizer step (as DDP's
        ``no_sync``): their gradients are summed locally and reduced once, with the last batch's."""
        with _set_up(self._gradients).accumulating():
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Put the gradients of the pipelined step in place, summed over replicas and ties (`GradientPhase`)."""
        _set_up(self._gradients).put_in_place()
        return closure_loss

    # ----------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (independent of the pipeline shape)."""
        return optimizer_state_by_name(torch_optimizer(optimizer), self._module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint to the folder ``filepath`` (any fsspec URL); every rank writes its stage."""
        optimizers, names = [torch_optimizer(o) for o in self.optimizers], self._parameter_groups.names
        tensors, lightning_state = split_stage_checkpoint(checkpoint, optimizers, names, self.root_device)
        topo = _set_up(self.topology)
        replicas, position = topo.data_parallel_size, self._data.saved(self._module.trainer)
        global_batch_size = self._batches.global_batch_size(replicas)
        shape = run_shape(topo.pipeline_parallel_size, replicas, self.micro_batch_size, global_batch_size, position)
        self._checkpoints.save(tensors, lightning_state, str(filepath), shape, storage_options)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        with stage_state_dicts():  # this stage's entries, which its part of a checkpoint saves
            return super().lightning_module_state_dict()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read this stage's part of a checkpoint written with any pipeline shape, or of a single-file Lightning
        checkpoint: one device's (``strategy="auto"``; it continues where that run's data loader would: an
        unfinished epoch starts again) or one that `consolidate` wrote (it continues where the sharded one would)."""
        optimizers = [torch_optimizer(o) for o in self.optimizers]
        fs, path = self.checkpoint_storage.fs(str(checkpoint_path))
        if single_file := fs.isfile(path):
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
            shape = checkpoint.get(RUN_SHAPE)  # (a plain file has none)
        else:
            checkpoint, info = self._checkpoints.load(str(checkpoint_path), self._module, optimizers)
            shape = info.shape
        self._batches.resumed(shape)
        self._data.restore((shape or {}).get("data_position"), checkpoint.get("loops", {}))
        if single_file:  # the whole model's: this stage's part of it
            return stage_checkpoint(checkpoint, self._module, _set_up(self._stages).skeleton, optimizers)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, by_name in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_optimizer_state_by_name(torch_optimizer(optimizer), self._module, by_name)
            optimizer_to_device(optimizer, self.root_device)

    def wait_for_checkpoints(self) -> None:
        """Return on every rank once the checkpoints saved so far are committed (with ``checkpoint_tempdir``:
        uploaded); raise on every rank if an upload failed. Collective."""
        self._checkpoints.wait(collective=True)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self._checkpoints.remove(str(filepath))

    # ----------------------------------------------------------------------------------------- the end
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leave this rank's error for the other ranks, unless another rank failed first (`failures`)."""
        if self._failures is not None:
            self._failures.report(exception)

    @override
    def teardown(self) -> None:
        """Wait for checkpoint uploads still in flight, then tear down as usual. After a normal run every rank waits
        until the last checkpoint is committed (all raise if an upload failed), so that the next
        ``fit(ckpt_path="last")`` sees it; after an error each rank only waits for its own uploads."""
        trainer = self._end_run()
        normal_end = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        if self._module_hooks is not None:
            self._module_hooks.restore()
            self._module_hooks = None
        try:
            if self._steps is not None and normal_end:  # after an error, a peer may never receive the step's results
                self._steps.results.flush(_set_up(self._failures).stop_if_job_ended)
            self._checkpoints.wait(collective=normal_end and distributed_is_initialized())
        finally:
            with self._released_slots_filled(torch.device("cpu")):  # Lightning moves the module to the CPU
                super().teardown()


def _set_up(part: T | None) -> T:
    """A part of the strategy that `VarunaStrategy.setup` (or `setup_environment`) makes."""
    if part is None:
        raise RuntimeError("VarunaStrategy is not set up: it partitions the model in `Trainer.fit/validate/...`.")
    return part


StrategyRegistry.register(
    VarunaStrategy.strategy_name, VarunaStrategy, description=(VarunaStrategy.__doc__ or "").splitlines()[0]
)
