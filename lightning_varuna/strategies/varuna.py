"""`VarunaStrategy`: pipeline x data parallel training of a LightningModule cut at its CutPoints."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, TypeVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.utils._pytree import tree_map
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset
from typing_extensions import override

from lightning_varuna._lightning_private import (
    default_process_group_backend,
    distributed_is_initialized,
    optimizer_to_device,
    optimizers_to_device,
)
from lightning_varuna.checkpoint.consolidate import RUN_SHAPE
from lightning_varuna.checkpoint.layout import run_shape
from lightning_varuna.checkpoint.sharded import ShardedCheckpoints
from lightning_varuna.checkpoint.single_file import stage_checkpoint
from lightning_varuna.checkpoint.state import (
    OPTIMIZER_PARAMETER_NAMES,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    parameter_group_names,
)
from lightning_varuna.data.resumable import DataProgress
from lightning_varuna.partition.plan import plan_stage
from lightning_varuna.pipeline.batch_norm import normalizes_over_the_batch, one_value_per_channel_refused
from lightning_varuna.pipeline.gradients import GradientPhase
from lightning_varuna.pipeline.microbatch import (
    batch_size_of,
    default_micro_batch_size,
    has_ignored_labels,
    microbatch_sizes,
    split_microbatches,
)
from lightning_varuna.pipeline.module_hooks import PipelinedModuleHooks
from lightning_varuna.pipeline.schedules import SCHEDULES, forward_only
from lightning_varuna.pipeline.stage import Stage
from lightning_varuna.pipeline.step import MicroBatchedStep, capture_forward_inputs
from lightning_varuna.pipeline.step_logging import replay
from lightning_varuna.pipeline.step_results import StepResults
from lightning_varuna.pipeline.topology import PipelineGroups, Topology
from lightning_varuna.pipeline.user_collectives import UserCollectives
from lightning_varuna.profiling.model_costs import ModelCosts
from lightning_varuna.spilling.grad_scaler import shardwise
from lightning_varuna.storage import Storage
from lightning_varuna.strategies.callback_hooks import callbacks_of, restore_callback_hooks, run_hook_inside
from lightning_varuna.strategies.clipping import route_gradient_clipping
from lightning_varuna.strategies.failures import RunFailures
from lightning_varuna.strategies.first_batch import STEP_OF_FN, first_batch
from lightning_varuna.strategies.launchers import MultiProcessingLauncher, SubprocessScriptLauncher
from lightning_varuna.strategies.mid_epoch_resume import accumulate_as_scheduled
from lightning_varuna.strategies.model_summary import summarize_whole_model
from lightning_varuna.strategies.one_batch import check_stages_read_one_batch
from lightning_varuna.strategies.optimizers import torch_optimizer
from lightning_varuna.strategies.process_groups import init_process_group, torchrun_layout
from lightning_varuna.strategies.requirements import WEIGHT_AVERAGING, require_automatic_optimization
from lightning_varuna.strategies.sigterm import stop_on_sigterm_without_broadcasts
from lightning_varuna.strategies.varuna_config import VarunaConfig

__all__ = ["VarunaStrategy"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class VarunaStrategy(ParallelStrategy):
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
        schedule: ``"1f1b"``, ``"gpipe"``, ``"varuna"`` (recompute each forward just before its backward), or
            ``"auto"``: the one the simulator predicts fastest with the other choices (needs ``profile``).
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
        shared_weights: list[tuple[str, str]] | None = None,
        profile_repeats: int = 3,
        profile: str | None = None,
        global_batch_size: int | None = None,
        loss_items: Callable[[Any], int | Tensor] | None = None,
        checkpoint_tempdir: str | None = None,
        storage_options: dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._config = VarunaConfig(
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            micro_batch_size=micro_batch_size,
            schedule=schedule,
            shared_weights=shared_weights,
            profile_repeats=profile_repeats,
            profile=profile,
            global_batch_size=global_batch_size,
            loss_items=loss_items,
        )
        # 0 until chosen: by the auto-configuration ("auto") or from the first batch (None, see `setup`).
        self.pipeline_parallel_size: int = pipeline_parallel_size if isinstance(pipeline_parallel_size, int) else 0
        self.micro_batch_size: int = micro_batch_size if isinstance(micro_batch_size, int) else 0
        self._micro_batch_size_chosen_for: TrainerFn | None = None  # the run whose batch chose the default
        self.data_parallel_size, self.schedule, self.global_batch_size = data_parallel_size, schedule, global_batch_size
        self.shared_weights, self.loss_items = self._config.shared_weights or [], loss_items
        self.profile_repeats, self.profile = profile_repeats, profile
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self.topology: Topology | None = None
        self._groups = PipelineGroups(None, None, (None, None))
        self._step_results: StepResults | None = None
        self._module_hooks: PipelinedModuleHooks | None = None
        self._collectives = UserCollectives()  # over all ranks until the job is laid out (`setup_environment`)
        self._stages: Stage | None = None
        self._gradients: GradientPhase | None = None
        self._failures: RunFailures | None = None  # of the current Trainer run
        self.checkpoint_storage = Storage(storage_options)
        self._costs = ModelCosts(profile, self.checkpoint_storage, profile_repeats)
        self._checkpoints = ShardedCheckpoints(self.checkpoint_storage, tempdir=checkpoint_tempdir)
        self._replica_batch_size: int | None = None
        self._check_iterable_batches = True
        self._resumed_shape: dict[str, Any] | None = None
        self._optimizer_parameter_names: list[list[list[str]]] = []  # the whole model's (`setup_optimizers`)
        self._data = DataProgress()

    # ----------------------------------------------------------------------------------------- processes
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of a replica read the same batches; replicas read disjoint ones.
        assert self.topology is not None
        return {"num_replicas": self.topology.data_parallel_size, "rank": self.topology.dp_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._follow_torchrun()
        if self._start_method == "popen":
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = MultiProcessingLauncher(self, start_method=self._start_method)

    def _follow_torchrun(self) -> None:
        """Under torchrun, take the processes per node and the node count from torchrun, not the Trainer."""
        assert self.cluster_environment is not None and self.parallel_devices is not None
        layout = torchrun_layout(self.cluster_environment, self.parallel_devices)
        if layout is not None:
            self.parallel_devices, self.num_nodes = layout

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        backend = self._process_group_backend or default_process_group_backend(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"device_id": self.root_device} if self.root_device.type != "cpu" else {}
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, backend, self._timeout, **kwargs)
        if self._config.auto:
            self._autoconfigure()
        self.topology = Topology.from_world(
            self.world_size, self.global_rank, self.pipeline_parallel_size, self.data_parallel_size
        )
        self._config.check_global_batch_splits(
            self.topology.data_parallel_size, self.world_size, self.pipeline_parallel_size
        )
        self._groups = self.topology.process_groups()
        self._collectives = UserCollectives(self.topology, self._groups)

    def _autoconfigure(self) -> None:
        """Choose what was left ``"auto"`` for this world size (`ModelCosts.choose_config`)."""
        auto = self._config.auto
        assert self.global_batch_size is not None
        best = self._costs.choose_config(
            self.world_size,
            self.global_batch_size,
            self.root_device,
            pipeline_parallel_size=None if "pipeline_parallel_size" in auto else self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            micro_batch_size=None if "micro_batch_size" in auto else self.micro_batch_size or None,
            schedule=None if "schedule" in auto else self.schedule,
            nodes=self.num_nodes,
        )
        self.pipeline_parallel_size, self.micro_batch_size = best.pipeline_parallel_size, best.micro_batch_size
        self.schedule = best.schedule

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._collectives.barrier()

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, self._collectives.group(group), sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collectives.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return self._collectives.reduce(tensor, group, reduce_op)

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None, "VarunaStrategy is used before Lightning connected the model"
        return module

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training DataLoader resumable mid-epoch and, with ``global_batch_size``, re-batch it."""
        trainer = self._module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        sampler = getattr(dataloader, "sampler", None)
        # Lightning's sampler over the dataset; not its wrapper of a custom sampler (a subclass), whose order it keeps.
        resumable = isinstance(dataloader, DataLoader) and type(sampler) is DistributedSampler
        if not resumable or type(getattr(dataloader, "batch_sampler", None)) is not BatchSampler:
            if self.global_batch_size is not None:
                raise ValueError(
                    "`VarunaStrategy(global_batch_size=...)` re-batches the training DataLoader, which needs a "
                    "map-style dataset, Lightning's distributed sampler (`Trainer(use_distributed_sampler=True)`), "
                    "no custom `sampler` and no `batch_sampler`. Remove `global_batch_size` and size the DataLoader "
                    "batch yourself: global batch = DataLoader batch x data_parallel_size."
                )
            return dataloader
        assert isinstance(dataloader, DataLoader) and isinstance(sampler, DistributedSampler)
        assert self.topology is not None
        batch_size = dataloader.batch_size
        assert batch_size is not None  # a plain BatchSampler
        if self.global_batch_size is not None:
            batch_size = self.global_batch_size // self.topology.data_parallel_size
        return self._data.resumable(dataloader, sampler, batch_size, self.topology.data_parallel_size)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        accumulate_as_scheduled(self._module.trainer)  # an epoch resumed mid-way ran no epoch-start hook
        self._data.warn_if_epoch_restarts(self._module.trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self._data.epoch_started(self._module.trainer.current_epoch)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        with self._released_slots_filled(self.root_device):
            self.model.to(self.root_device)

    def _released_slots_filled(self, device: torch.device) -> AbstractContextManager[None]:
        """While the module moves: memory-free stand-ins on ``device`` where this rank released another stage's
        tensors (after a fit), since a module's own ``_apply`` may read one (timm's rotary embedding)."""
        module, stages = self.lightning_module, self._stages
        if stages is None or module is None:
            return nullcontext()
        return stages.skeleton.stand_ins(module, missing_only=True, device=device)

    # -------------------------------------------------------------------------------------- partitioning
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._failures = RunFailures(trainer, self.global_rank, self.topology)
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        require_automatic_optimization(
            self._module, "VarunaStrategy", "the pipelined forward and backward of `training_step`"
        )
        assert self.topology is not None
        averaging = callbacks_of(trainer, WEIGHT_AVERAGING)
        if averaging and self.topology.pipeline_parallel_size > 1:
            raise ValueError(
                f"`{type(averaging[0]).__name__}` keeps an average of every parameter of the model, but with "
                f"{self.topology.pipeline_parallel_size} pipeline stages each process holds only its stage's. Train "
                "with `pipeline_parallel_size=1` (data parallel: every process holds the whole model), or without the "
                "callback."
            )
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # The default comes from the training batch, also where a `validate` on the same Trainer chose one first.
        chosen_for_another_run = self._micro_batch_size_chosen_for not in (None, TrainerFn.FITTING)
        if not self.micro_batch_size or (trainer.state.fn == TrainerFn.FITTING and chosen_for_another_run):
            self._choose_micro_batch_size(trainer)
        if self._stages is None or self._stages.module is not self.model:
            with self.precision_plugin.tensor_init_context():  # as in the steps: the forward's new tensors ("true")
                self._stages = self._partition(trainer)
        summarize_whole_model(trainer, self._stages.skeleton)
        assert self.topology is not None
        if self.topology.pipeline_parallel_size > 1:
            self._module_hooks = PipelinedModuleHooks(
                self._module,
                self.topology.is_last_stage,
                lambda: self._collectives.over_last_stages(self._module),
                self._exchange_results,
                self._collectives.gather_from_stages,
            )
        # Finetuning callbacks add parameter groups as training goes, as `configure_optimizers` makes them.
        run_hook_inside(trainer, BaseFinetuning, "on_train_epoch_start", lambda _: self._whole_model_for_optimizers())
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_iterable_batches = True
        self.setup_precision_plugin()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not self.topology.is_last_stage:
            # Only the last stage scales a loss; scaling nothing gives the others' scalers the scale unscale_ needs.
            scaler.scale(torch.zeros((), device=self.root_device))
        gradients = self._gradients = GradientPhase(
            self._stage_plan(),
            self.topology,
            self._groups,
            self.root_device,
            on_wait=self._failures.stop_if_job_ended,
            note_overflow=shardwise(scaler).note_found_inf if scaler is not None else None,
        )
        route_gradient_clipping(self.precision_plugin, lambda _, clip_val: gradients.clip_by_global_norm(clip_val))
        if self._stage_plan().runtime.waiter.polls:
            stop_on_sigterm_without_broadcasts(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """`configure_optimizers` sees the whole model (memory-free stand-ins of the other stages' parameters), and
        each of its parameter groups then keeps this stage's parameters, maybe none: every stage has the groups of
        one device (for schedulers and callbacks that index them), and a stage whose parameters are all frozen gets
        an optimizer over none rather than an error."""
        with self._whole_model_for_optimizers():
            super().setup_optimizers(trainer)

    @contextmanager
    def _whole_model_for_optimizers(self) -> Iterator[None]:
        """Inside, the other stages' parameters have stand-ins; after, the optimizers' groups hold none of them."""
        module = self._module
        with self._stage_plan().skeleton.stand_ins(module, missing_only=True):
            yield
            optimizers = [torch_optimizer(o) for o in self.optimizers]
            self._optimizer_parameter_names = parameter_group_names(optimizers, module)
        own = {id(p) for p in module.parameters()}
        for optimizer in self.optimizers:
            for group in torch_optimizer(optimizer).param_groups:
                group["params"] = [p for p in group["params"] if id(p) in own]

    def _choose_micro_batch_size(self, trainer: pl.Trainer) -> None:
        """The default ``micro_batch_size``, from the replica's batch and the number of stages (logged once)."""
        assert self.topology is not None
        num_stages = self.topology.pipeline_parallel_size
        if self.global_batch_size is not None:
            rows = self.global_batch_size // self.topology.data_parallel_size
        else:
            rows = batch_size_of(first_batch(trainer))
        min_rows = 2 if normalizes_over_the_batch(self._module) else 1  # BatchNorm cannot train on one row
        self.micro_batch_size = default_micro_batch_size(rows, num_stages, min_rows)
        self._micro_batch_size_chosen_for = trainer.state.fn
        count = len(microbatch_sizes(rows, self.micro_batch_size))
        rank_zero_info(
            f"VarunaStrategy: micro_batch_size={self.micro_batch_size} ({count} micro-batch(es) of the batch of {rows} "
            f"rows for {num_stages} stage(s)); pass `micro_batch_size=` to choose another."
        )

    def _partition(self, trainer: pl.Trainer) -> Stage:
        module = self.lightning_module
        assert module is not None and self.topology is not None
        for keep, tie in self.shared_weights:
            owner, _, name = tie.rpartition(".")
            module.get_submodule(owner).register_parameter(name, module.get_parameter(keep))
        args, kwargs = self._example_forward_inputs(trainer)
        advice = f"Pass `VarunaStrategy(micro_batch_size=2)` or more (it is {self.micro_batch_size})."
        with one_value_per_channel_refused(module, advice):
            stage = plan_stage(
                module,
                args,
                kwargs,
                self.topology,
                lambda cutpoints: self._costs.segment_costs(
                    module,
                    args,
                    kwargs,
                    cutpoints,
                    micro_batch_size=self.micro_batch_size,
                    processes_per_node=self.num_processes,
                ),
                self.root_device,
                self._groups,
            )
        cut = f"cut at CutPoints {stage.boundaries}" if stage.boundaries else "not cut"
        rank_zero_info(f"VarunaStrategy: {self.topology.pipeline_parallel_size} stage(s), {cut}")
        if normalizes_over_the_batch(module):
            rank_zero_info(
                f"VarunaStrategy: batch normalization sees one micro-batch ({self.micro_batch_size} rows) at a time, "
                "as in GPipe; every replica keeps the first replica's running statistics, as DDP does."
            )
        self._step_results = StepResults(self.topology, self._groups.results, stage.runtime.waiter)
        return stage

    def _example_forward_inputs(self, trainer: pl.Trainer) -> tuple[tuple, dict]:
        """Forward arguments of one micro-batch: what the first step passes to ``self(...)`` (which also checks
        that the step calls it; ``example_input_array`` would not)."""
        module = self.lightning_module
        assert module is not None
        batch = self.batch_to_device(first_batch(trainer))
        microbatch = split_microbatches(batch, self.micro_batch_size)[0]
        assert trainer.state.fn is not None
        return capture_forward_inputs(module, STEP_OF_FN[trainer.state.fn], microbatch)

    # ------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        rows = batch_size_of(args[0])
        self._check_micro_batch_size(rows)
        self._check_global_batch(rows)
        assert self.topology is not None
        if self._check_iterable_batches:  # the first batch of a fit (`one_batch`, and ignored labels)
            self._check_iterable_batches = False
            if self.loss_items is None and rows > self.micro_batch_size and has_ignored_labels(args[0]):
                rank_zero_warn(
                    'The batch\'s "labels" hold -100 (tokens without a label): if the loss is a mean over the '
                    "labelled tokens, micro-batches counted by rows do not train on the batch's mean; pass "
                    '`VarunaStrategy(loss_items=lambda batch: (batch["labels"] != -100).sum())` (for a causal LM, '
                    'which predicts each next token: `batch["labels"][:, 1:]`).'
                )
            loader = self._module.trainer.train_dataloader
            if (
                isinstance(getattr(loader, "dataset", None), IterableDataset)
                and self.topology.pipeline_parallel_size > 1
            ):
                check_stages_read_one_batch(
                    args[0], self._groups.stages, self.topology.pipeline_parallel_size, self.root_device
                )
        self._data.advance(rows * self.topology.data_parallel_size, self._module.trainer)
        with (
            _set_up(self._gradients).computing(),
            self.precision_plugin.train_step_context(),
        ):
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
        module, stage, topo = self._module, self._stage_plan(), self.topology
        assert topo is not None
        batch = args[0]
        make = SCHEDULES[self.schedule] if backward else forward_only
        actions = make(topo.pipeline_parallel_size, len(microbatch_sizes(batch_size_of(batch), self.micro_batch_size)))
        scaler = getattr(self.precision_plugin, "scaler", None) if backward else None
        step = MicroBatchedStep(
            module,
            stage,
            step_name,
            args[1:],
            kwargs,
            loss_weight=self._share_of_items(batch) / module.trainer.accumulate_grad_batches if backward else 1.0,
            scale_loss=scaler.scale if scaler is not None else None,
            loss_items=self.loss_items,
        )
        failures = _set_up(self._failures)
        with failures.reported():
            outputs = step.run(
                batch,
                self.micro_batch_size,
                actions[topo.pp_rank],
                training=backward,
                on_wait=failures.stop_if_job_ended,
            )
            summary, outputs = self._exchange_results((step.recorder.summary(), outputs))
        replay(module, summary, self.root_device)
        return tree_map(lambda t: t.to(self.root_device) if isinstance(t, Tensor) else t, outputs)

    def _share_of_items(self, batch: Any) -> float:
        """This replica's share of the items (`loss_items`) of every replica's batch, on the last stage (where
        losses are weighted): 1 / replicas for rows, which every replica has as many of."""
        topo = self.topology
        assert topo is not None
        if self.loss_items is None or topo.data_parallel_size == 1 or not topo.is_last_stage:
            return 1 / topo.data_parallel_size
        items = torch.as_tensor(self.loss_items(batch), dtype=torch.float64, device=self.root_device)
        every_replica = items.clone()
        dist.all_reduce(every_replica, group=self._groups.replicas)
        return float(items / every_replica)

    def _exchange_results(self, results: Any) -> Any:
        """Send ``results`` from the last stage to the replica's other stages (see `StepResults`)."""
        assert self._step_results is not None
        return self._step_results.exchange(results, _set_up(self._failures).stop_if_job_ended)

    def record_timeline(self) -> None:
        """Record when each action of the coming training steps runs on this rank (see `PipelineTrace`)."""
        self._stage_plan().runtime.timeline = []

    def take_timeline(self) -> list[tuple[str, float, float]]:
        """Stop recording; return this rank's ``(action, start, end)`` in wall-clock seconds."""
        runtime = self._stage_plan().runtime
        timeline, runtime.timeline = runtime.timeline or [], None
        return timeline

    def _check_micro_batch_size(self, rows: int) -> None:
        # Against the largest batch seen: a short last batch is simply one smaller micro-batch.
        rows = max(rows, self._replica_batch_size or 0)
        if self.micro_batch_size > rows:
            raise ValueError(
                f"`VarunaStrategy(micro_batch_size={self.micro_batch_size})` is larger than the batch of {rows} rows; "
                f"use micro_batch_size <= {rows} or a larger DataLoader batch_size."
            )

    def _check_global_batch(self, rows: int) -> None:
        assert self.topology is not None
        # The largest batch seen: a short last batch does not define the run's global batch.
        self._replica_batch_size = max(self._replica_batch_size or 0, rows)
        if self._resumed_shape is None:
            return
        before, self._resumed_shape = self._resumed_shape.get("global_batch_size"), None
        now = self._replica_batch_size * self.topology.data_parallel_size
        if before is not None and before != now:
            rank_zero_warn(
                f"Resumed from a checkpoint trained with a global batch of {before} rows; this run's is {now} "
                f"(DataLoader batch {self._replica_batch_size} x data_parallel_size "
                f"{self.topology.data_parallel_size}). Set the DataLoader batch to {before} / data_parallel_size "
                "to continue the same training."
            )

    # ------------------------------------------------------------------------------ gradients and step
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
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A checkpoint is loaded by parameter name into the stage this rank holds: after partitioning.
        return True

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (independent of the pipeline shape)."""
        return optimizer_state_by_name(torch_optimizer(optimizer), self._module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint to the folder ``filepath`` (any fsspec URL); every rank writes its stage."""
        lightning_state = dict(checkpoint)
        tensors: dict[str, Any] = {"model": lightning_state.pop("state_dict")}
        optimizer_states = lightning_state.pop("optimizer_states", None)
        if optimizer_states is not None:
            tensors["optimizer"] = {str(i): state for i, state in enumerate(optimizer_states)}
            if self._groups_as_recorded():
                lightning_state[OPTIMIZER_PARAMETER_NAMES] = self._optimizer_parameter_names
        topo = self.topology
        assert topo is not None
        global_batch_size = (
            None if self._replica_batch_size is None else self._replica_batch_size * topo.data_parallel_size
        )
        shape = run_shape(
            topo.pipeline_parallel_size,
            topo.data_parallel_size,
            self.micro_batch_size,
            global_batch_size,
            self._data.saved(self._module.trainer),
        )
        self._checkpoints.save(tensors, lightning_state, str(filepath), shape, storage_options)

    def _groups_as_recorded(self) -> bool:
        """Whether every stage's optimizers have as many groups as when the whole model's names were recorded (a
        callback may have added one on the stages holding its parameters since, BaseFinetuning aside). Collective."""
        counts = [len(torch_optimizer(o).param_groups) for o in self.optimizers]
        same = torch.tensor(int(counts == [len(groups) for groups in self._optimizer_parameter_names]))
        same = same.to(self.root_device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        return bool(same.item())

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read this stage's part of a checkpoint written with any pipeline shape, or of a single-file Lightning
        checkpoint: one device's (``strategy="auto"``; it continues where that run's data loader would: an
        unfinished epoch starts again) or one that `consolidate` wrote (it continues where the sharded one would)."""
        optimizers = [torch_optimizer(o) for o in self.optimizers]
        fs, path = self.checkpoint_storage.fs(str(checkpoint_path))
        if fs.isfile(path):
            whole = super().load_checkpoint(checkpoint_path, weights_only)
            self._resumed_shape = whole.get(RUN_SHAPE)  # (a plain file has none)
            self._data.restore((self._resumed_shape or {}).get("data_position"), whole.get("loops", {}))
            return stage_checkpoint(whole, self._module, self._stage_plan().skeleton, optimizers)
        checkpoint, info = self._checkpoints.load(str(checkpoint_path), self._module, optimizers)
        self._resumed_shape = info.shape
        self._data.restore(info.shape.get("data_position"), checkpoint.get("loops", {}))
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

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leave this rank's error for the other ranks, unless another rank failed first (`failures`)."""
        if self._failures is not None:
            self._failures.report(exception)

    @override
    def teardown(self) -> None:
        """Wait for checkpoint uploads still in flight, then tear down as usual.

        After a normal run every rank waits until the last checkpoint is committed (and all raise if an upload
        failed), so that the next ``fit(ckpt_path="last")`` sees it; after an error each rank only waits for its
        own uploads.
        """
        self._data.fit_ended()
        trainer = getattr(self.lightning_module, "_trainer", None)
        normal_end = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        if trainer is not None:
            restore_callback_hooks(trainer)
        if self._module_hooks is not None:
            self._module_hooks.restore()
            self._module_hooks = None
        try:
            if self._step_results is not None and normal_end:  # after an error, a peer may never receive them
                self._step_results.flush(_set_up(self._failures).stop_if_job_ended)
            self._checkpoints.wait(collective=normal_end and distributed_is_initialized())
        finally:
            with self._released_slots_filled(torch.device("cpu")):  # Lightning moves the module to the CPU
                super().teardown()

    def _stage_plan(self) -> Stage:
        return _set_up(self._stages)


def _set_up(part: T | None) -> T:
    """A part of the strategy that `VarunaStrategy.setup` makes."""
    if part is None:
        raise RuntimeError("VarunaStrategy is not set up: it partitions the model in `Trainer.fit/validate/...`.")
    return part


StrategyRegistry.register(
    VarunaStrategy.strategy_name, VarunaStrategy, description=(VarunaStrategy.__doc__ or "").splitlines()[0]
)
