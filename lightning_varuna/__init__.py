"""lightning-varuna: pipeline x data parallel training of LightningModules sliced at CutPoints."""

from lightning_varuna.callbacks import MorphCallback, PipelineTrace
from lightning_varuna.cutpoint import CutPoint
from lightning_varuna.strategies import VarunaStrategy

__all__ = ["CutPoint", "MorphCallback", "PipelineTrace", "VarunaStrategy"]
__version__ = "0.1.0"
