"""Training spilled where `VarunaStrategy`'s auto-configuration chose it (one process, a memory budget that the
model does not fit whole, and spilling predicted fastest): the Trainer is handed to a `SpillingStrategy` that reads
the data and ties the weights as the pipelined run would, so that one script and one config train either way and a
job that morphs between them trains the same model."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_varuna.data.one_device import resumable_on_one_device
from lightning_varuna.pipeline.shared_params import tie_weights
from lightning_varuna.profiling.profiler import resize_batch
from lightning_varuna.profiling.spilled import SpilledConfig
from lightning_varuna.strategies.resumable_training import ResumableTraining
from lightning_varuna.strategies.spilling import SpillingStrategy
from lightning_varuna.strategies.varuna_config import VarunaConfig

__all__ = ["ChosenSpilling", "train_spilled"]


class ChosenSpilling(SpillingStrategy):
    """`SpillingStrategy` as `VarunaStrategy` trains when its auto-configuration chose ``config``: the training
    DataLoader read as a pipeline of one replica reads it (Lightning's distributed order, shuffled by the seed and the
    epoch, re-batched to ``global_batch_size`` rows), ``shared_weights`` tied, and ``spill_dir`` used only if the
    choice spills to disk. Its checkpoints are the sharded ones either strategy resumes."""

    def __init__(
        self,
        config: SpilledConfig,
        *,
        spill_dir: str | None,
        global_batch_size: int | None,
        shared_weights: list[tuple[str, str]],
        storage_options: dict[str, Any] | None,
        checkpoint_io: CheckpointIO | None,
        precision_plugin: Precision | None,
    ) -> None:
        super().__init__(
            memory_budget=config.memory_budget,
            spill_dir=spill_dir if config.tier == "disk" else None,
            storage_options=storage_options,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.chosen = config
        self.global_batch_size, self.shared_weights = global_batch_size, shared_weights

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._module.trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        return resumable_on_one_device(dataloader, self._data, shuffle=True, batch_size=self.global_batch_size)

    @override
    def _first_batch(self, trainer: pl.Trainer) -> Any:
        """The loader's first batch at the size training re-batches it to (the shards are planned for that)."""
        batch = super()._first_batch(trainer)
        if trainer.state.fn != TrainerFn.FITTING or self.global_batch_size is None:
            return batch
        return resize_batch(batch, self.global_batch_size)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        tie_weights(self._module, self.shared_weights)
        super().setup(trainer)


def train_spilled(strategy: ResumableTraining, config: SpilledConfig, asked: VarunaConfig) -> ChosenSpilling:
    """From ``strategy``'s ``setup_environment`` on, its Trainer trains spilled as ``config`` says, on ``strategy``'s
    device, with what VarunaStrategy was ``asked`` for: Lightning calls every later hook of this run, and of the
    Trainer's later runs, on the `ChosenSpilling` returned (``trainer.strategy``)."""
    if asked.checkpoint_tempdir is not None:
        rank_zero_warn(
            f"VarunaStrategy(checkpoint_tempdir={asked.checkpoint_tempdir!r}) is not used while the job trains "
            "spilled: SpillingStrategy writes each checkpoint to its URL directly, a shard at a time."
        )
    spilled = ChosenSpilling(
        config,
        spill_dir=asked.spill_dir,
        global_batch_size=asked.global_batch_size,
        shared_weights=asked.shared_weights or [],
        storage_options=strategy.checkpoint_storage.storage_options,
        checkpoint_io=strategy.checkpoint_io,
        precision_plugin=strategy.precision_plugin,
    )
    if strategy.accelerator is not None:
        spilled.accelerator = strategy.accelerator
    spilled.parallel_devices = [strategy.root_device]
    spilled._configure_launcher()  # for the Trainer's later runs
    spilled.connect(strategy._module)
    strategy._module.trainer._accelerator_connector.strategy = spilled
    spilled.setup_environment()
    return spilled
