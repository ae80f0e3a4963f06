"""Train a model larger than the device's memory on one device: its shards take turns on it (Hydra's spilling)."""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics import Metric
from typing_extensions import override

from lightning_varuna.checkpoint.layout import run_shape
from lightning_varuna.data.microbatch import batch_size_of
from lightning_varuna.data.one_device import lightning_seed, resumable_on_one_device
from lightning_varuna.partition.discovery import buffers_kept
from lightning_varuna.partition.packing import SegmentMemory, parse_bytes
from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.pipeline.step import capture_forward_inputs, patched_forward
from lightning_varuna.random_states import global_random_states_kept
from lightning_varuna.spilling.checkpoints import SpilledCheckpoints
from lightning_varuna.spilling.folder import SpillFolder
from lightning_varuna.spilling.grad_scaler import ShardwiseGradScaler, shardwise
from lightning_varuna.spilling.materialize import MetaModel, ParkedSegments
from lightning_varuna.spilling.optimizer_step import ShardwiseStep
from lightning_varuna.spilling.planning import plan_shards
from lightning_varuna.spilling.shards import ShardedModel, any_time
from lightning_varuna.strategies.clipping import route_gradient_clipping
from lightning_varuna.strategies.first_batch import STEP_OF_FN, first_batch
from lightning_varuna.strategies.launchers import InProcessLauncher
from lightning_varuna.strategies.model_summary import summarize_whole_model
from lightning_varuna.strategies.optimizers import optimized_parameters, torch_optimizer
from lightning_varuna.strategies.resumable_training import ResumableTraining
from lightning_varuna.strategies.spilling_requirements import (
    check_callbacks_of_spilled_model,
    check_module_to_spill,
    one_optimizer,
    shards_may_step_in_backward,
)

__all__ = ["SpillingStrategy"]

log = logging.getLogger(__name__)


class SpillingStrategy(ResumableTraining, SingleDeviceStrategy):
    """Train on one device a model larger than its memory, by spilling shards to host memory or disk.

    The model is cut at its CutPoints into segments, packed into shards from their measured memory so that one
    shard's training plus the next shard, fetched meanwhile, fit ``memory_budget``. Forward runs shard by shard
    keeping only the activations at shard boundaries; backward runs in reverse, recomputing each shard's forward
    (same random numbers); the optimizer steps shard by shard, each shard's parameters, gradients and optimizer
    state on the device together. A model that fits the budget whole is not cut, nor spilled: it trains as on one
    device, by its own forward and backward (nothing is fetched beside it, so all of the budget is its room).

    Args:
        memory_budget: what the strategy may hold on the device: bytes, a size such as ``"512MB"`` or ``"2GiB"``,
            or a share of the device's memory such as ``"50%"``; default: what the device has free.
        spill_dir: a folder for spilled shards (one file per shard part, read back ahead of use), or None to keep
            them in host memory.
        prefetch: fetch the next shard while the current one computes.
        storage_options: fsspec options (credentials, ``endpoint_url``...) for every checkpoint URL.

    Checkpoints are written a shard at a time in VarunaStrategy's sharded format (a folder at any fsspec URL), so
    either strategy resumes the other's, at any pipeline shape. The training DataLoader resumes mid-epoch where a
    checkpoint left off: its order is that of Lightning's `DistributedSampler` for one replica (with ``shuffle=True``
    a permutation seeded by ``seed_everything`` and the epoch, as under VarunaStrategy).
    """

    strategy_name = "spilling"

    def __init__(
        self,
        memory_budget: int | float | str | None = None,
        spill_dir: str | Path | None = None,
        prefetch: bool = True,
        storage_options: dict[str, Any] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            storage_options=storage_options,
            device="cpu",
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.memory_budget = parse_bytes(memory_budget) if memory_budget is not None else None
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.prefetch = prefetch
        self.data_seed: int | None = None  # the training data's shuffled order's; None: `seed_everything`'s at fit
        self._devices: list[torch.device] = []
        self._sharded: ShardedModel | None = None
        self._folder: SpillFolder | None = None
        self.shards: list[list[int]] = []  # the segments of each shard, chosen at set-up
        self.recomputing_shards: list[int] = []  # those that compute their forward again in backward (no room)
        self.budget_bytes: int | None = None  # `memory_budget` in bytes, at set-up
        # What each segment was measured to need on the device (one entry for a model that fits in one shard).
        self.segment_memory: list[SegmentMemory] = []
        self.kept_bytes = 0  # what stays on the device throughout (boundary activations, buffers, tied weights)
        self.optimizer_in_backward = False  # each shard steps right after its backward (decided at set-up)
        self.forward_draws = True  # whether the forward drew random numbers (CPU's or GPU's) when measured at set-up
        # The optimizer step whose closure runs now: Lightning calls `backward` (and clipping) from inside it with no
        # way to pass it on, and its backward steps or unscales the shards as the step says.
        self._step: ShardwiseStep | None = None
        self._checkpoints = SpilledCheckpoints(self.checkpoint_storage)
        self._batch_size: int | None = None  # the largest training batch so far
        self._parked: ParkedSegments | None = None  # segments of a meta-device model materialized at set-up

    # ------------------------------------------------------------------------------------------- the device
    @property
    def parallel_devices(self) -> list[torch.device]:
        """The Trainer's devices (Lightning sets them): one."""
        return self._devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        if len(devices) > 1:
            raise ValueError(
                f"SpillingStrategy trains one model on one device, but the Trainer has {len(devices)} devices. Use "
                "`Trainer(devices=1)`; to train one model on several devices use `VarunaStrategy` (pipeline and "
                "data parallel), to train several models at once use `MultiModelTrainer`."
            )
        self._devices = list(devices)
        if devices:
            self._root_device = torch.device(devices[0])

    @override
    def _configure_launcher(self) -> None:
        """Train in this process, resolving ``ckpt_path="last"`` to the newest complete sharded checkpoint."""
        self._launcher = InProcessLauncher()

    # ------------------------------------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training DataLoader resumable mid-epoch (a map-style dataset read in order or shuffled)."""
        if self._module.trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        return resumable_on_one_device(dataloader, self._data, seed=self.data_seed)

    def seed_data_order_now(self) -> None:
        """Shuffle the training data with the seed `L.seed_everything` set now, not as the fit starts (a sweep's
        model, added now and fitted when the sweep fits)."""
        self.data_seed = lightning_seed()

    # ---------------------------------------------------------------------------------------------- set-up
    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds the model on the meta device: set-up gives it memory a segment at a time."""
        with torch.device("meta"):
            yield

    @override
    def model_to_device(self) -> None:
        """The model stays where it is built (host memory); shards visit the device when they run. Its ``device``
        is the device's, where its inputs and outputs are (user code makes tensors on ``self.device``), and its
        torchmetrics metrics, which take those outputs, move there."""
        _update_properties(self._module, device=self.root_device)
        for name, metric in self._module.named_modules():
            if not isinstance(metric, Metric):
                continue
            if any(isinstance(t, Tensor) and t.is_meta for t in metric.metric_state.values()):
                raise ValueError(
                    f"The torchmetrics metric `{name}` was built in `configure_model`, where SpillingStrategy builds "
                    "on the meta device: a metric's starting values are lost there. Build metrics in `__init__`."
                )
            metric.to(self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Cut the model into shards that fit the budget (measured on the first batch) and spill them."""
        check_module_to_spill(self._module, self.root_device)
        super().setup(trainer)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:  # fp16's ("16-mixed")
            shardwise(scaler)
        summarize_whole_model(trainer, ModelSkeleton(self._module, device=torch.device("meta")))
        if self._sharded is None:
            self._sharded = self._shard(trainer)
        route_gradient_clipping(self.precision_plugin, self._clip_by_norm, self._clip_by_value)
        optimizer = one_optimizer(self.optimizers, self._module)
        if not self._sharded.stays:
            check_callbacks_of_spilled_model(trainer, len(self.shards), optimizer)
        self._sharded.spill_all(optimizer, fill=self._parked.unpark if self._parked is not None else None)
        self._parked = None
        self.optimizer_in_backward = shards_may_step_in_backward(trainer, loss_scaled=self._scaler() is not None)

    def _shard(self, trainer: pl.Trainer) -> ShardedModel:
        module = self._module
        assert trainer.state.fn is not None
        # Measuring runs the model: training's random numbers and BatchNorm's statistics stay as they are, and the
        # forward's new tensors get the precision's dtype as in the steps (a "true" precision sets it).
        with (
            global_random_states_kept(self.root_device),
            buffers_kept(module),
            self.precision_plugin.tensor_init_context(),
        ):
            batch = self.batch_to_device(self._first_batch(trainer))
            args, kwargs = capture_forward_inputs(module, STEP_OF_FN[trainer.state.fn], batch)
            plan = plan_shards(
                module,
                args,
                kwargs,
                self.root_device,
                self.memory_budget,
                self.spill_dir,
                self.prefetch,
                self._tracing,
                self._turn,
                whole_stays=self._keeps_whole_model(),
                training=trainer.state.fn == TrainerFn.FITTING,
                stepped=[p for optimizer in self.optimizers for p in optimized_parameters(optimizer)],
            )
        self.segment_memory, self.kept_bytes = plan.segment_memory, plan.kept_bytes
        self.shards, self.budget_bytes = plan.shards, plan.budget
        self.recomputing_shards = [k for k, keeps in enumerate(plan.model.packing.keeps[:-1]) if not keeps]
        self._parked, self._folder = plan.parked, plan.folder
        self.forward_draws = plan.forward_draws
        return plan.model

    def _first_batch(self, trainer: pl.Trainer) -> Any:
        """The batch the shards are planned for: the first of the loop about to run."""
        return first_batch(trainer)

    # ----------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        rows = batch_size_of(args[0])
        self._batch_size = max(self._batch_size or 0, rows)
        self._data.advance(rows, self._module.trainer)
        self._sharded_model().discard_calls()  # of a step that ran no backward
        with self._forward_through_shards():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_through_shards():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_through_shards():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_through_shards():
            return super().predict_step(*args, **kwargs)

    def _forward_through_shards(self) -> AbstractContextManager[None]:
        """The user's step calls ``self(...)``: the forward runs shard by shard for the step's duration."""
        return patched_forward(self._module, self._sharded_model().forward)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward through the last shard, then each shard's in reverse (`ShardwiseStep.backward`)."""
        with self._step.backward() if self._step is not None else self._sharded_model().backward():
            super().backward(closure_loss, optimizer, *args, **kwargs)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's closure (training step, backward, clipping request), then the optimizer shard by shard."""
        step = self._step = ShardwiseStep(optimizer, self._sharded_model(), self.optimizer_in_backward, self._scaler())
        try:
            result = self.precision_plugin.optimizer_step(step, model=model or self._module, closure=closure, **kwargs)
        finally:
            self._step = None
        if not step.ran:  # the grad scaler skipped the step (an overflow), or the closure returned None
            self._sharded_model().drop_gradients()
        return result

    def spilled_grad_norms(self) -> dict[nn.Parameter, Tensor]:
        """The 2-norm of each spilled parameter's gradient after the last backward (a spilled parameter holds no
        ``.grad``): what `lightning_varuna.grad_norm` reads in ``on_before_optimizer_step``."""
        return self._sharded.spilled_grad_norms() if self._sharded is not None else {}

    def _scaler(self) -> ShardwiseGradScaler | None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if isinstance(scaler, ShardwiseGradScaler) else None

    def _clip_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._running_step().clip_by_norm(float(clip_val))

    def _clip_by_value(self, optimizer: Any, clip_val: float) -> None:
        self._running_step().clip_by_value(float(clip_val))

    def _running_step(self) -> ShardwiseStep:
        if self._step is None:
            raise RuntimeError(
                "SpillingStrategy clips the gradients of a whole optimizer step, whose shards are spilled outside it: "
                "clip them in `configure_gradient_clipping` (or with `Trainer(gradient_clip_val=...)`)."
            )
        return self._step

    # How the model shares its device: alone here; a sweep's model (`MultiModelTrainer`) overrides these.
    def _tracing(self) -> AbstractContextManager[None]:
        """Where each trace of the model's forward runs (a sweep's model traces while the others wait)."""
        return nullcontext()

    def _turn(self, work: str, shard: int) -> AbstractContextManager[bool]:
        """Where each piece of a shard's work runs (`ShardedModel`): at once (a sweep's waits for a device)."""
        return any_time(work, shard)

    def _keeps_whole_model(self) -> bool:
        """Whether a model that fits its budget in one shard stays on the device (a sweep's may not: they share it)."""
        return True

    def _sharded_model(self) -> ShardedModel:
        if self._sharded is None:
            raise RuntimeError("SpillingStrategy is not set up: it shards the model in `Trainer.fit/validate/...`.")
        return self._sharded

    # ----------------------------------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty while the model is spilled: `save_checkpoint` writes its tensors a shard at a time."""
        return {} if self._sharded is not None else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Empty: `save_checkpoint` writes the optimizer state a shard at a time, by parameter name."""
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint (VarunaStrategy's format) to the folder ``filepath`` (any fsspec URL), one shard
        at a time: the model is never gathered."""
        shape = run_shape(1, 1, None, self._batch_size, self._data.saved(self._module.trainer))
        optimizer = torch_optimizer(self.optimizers[0]) if self.optimizers else None
        self._checkpoints.save(checkpoint, str(filepath), shape, self._module, optimizer, self._visit, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The training state of a checkpoint of SpillingStrategy or VarunaStrategy (any shape), or of a plain
        Lightning checkpoint file; its tensors are read a shard at a time by `load_model_state_dict` and
        `load_optimizer_state_dict`."""
        optimizers = [torch_optimizer(o) for o in self.optimizers]
        load_file = partial(super().load_checkpoint, checkpoint_path, weights_only)
        checkpoint, shape = self._checkpoints.load(str(checkpoint_path), self._module, optimizers, load_file)
        self._data.restore(shape.get("data_position"), checkpoint.get("loops", {}))
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._checkpoints.load_model(self._module, self._visit)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._checkpoints.load_optimizer(self._module, torch_optimizer(self.optimizers[0]), self._visit)

    def _visit(self, parts: tuple[str, ...] = (), write: tuple[str, ...] = ()) -> Iterator[list[nn.Parameter]]:
        """The model's parameters a shard at a time (`ShardedModel.visit`); all at once if it is not spilled."""
        if self._sharded is None:
            return iter([list(self._module.parameters())])
        return self._sharded.visit(parts, write)

    @override
    def teardown(self) -> None:
        """The model gets its parameters back (in host memory) for whatever follows ``fit``."""
        self._end_run()
        if self._sharded is not None:
            self._sharded.restore(torch.device("cpu"))  # host memory: the whole model may not fit the device
            self._sharded = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        self._parked = None
        module = self.lightning_module
        if module is not None and MetaModel.needed(module):
            # Set-up failed before the model had memory: it stays on the meta device, which cannot move to the CPU.
            self.precision_plugin.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()


StrategyRegistry.register(
    SpillingStrategy.strategy_name, SpillingStrategy, description=(SpillingStrategy.__doc__ or "").splitlines()[0]
)
