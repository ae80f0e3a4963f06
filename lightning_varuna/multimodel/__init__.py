"""Hydra's multi-model training: the models of a sweep trained together, their shards interleaved over devices."""

from lightning_varuna.multimodel.report import ModelResult
from lightning_varuna.multimodel.scheduler import DeviceScheduler, SweepStopped
from lightning_varuna.multimodel.trainer import MultiModelTrainer

__all__ = ["DeviceScheduler", "ModelResult", "MultiModelTrainer", "SweepStopped"]
