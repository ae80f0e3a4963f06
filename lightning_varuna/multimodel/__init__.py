"""Multi-model training (layer 9, Hydra): the models of a sweep trained together under `SpillingStrategy`, their
shards interleaved over the devices by a longest-remaining-time-first scheduler; Optuna studies trained as one sweep."""

from lightning_varuna.multimodel.report import ModelResult
from lightning_varuna.multimodel.scheduler import DeviceScheduler, SweepStopped
from lightning_varuna.multimodel.trainer import MultiModelTrainer

__all__ = ["DeviceScheduler", "ModelResult", "MultiModelTrainer", "SweepStopped"]
