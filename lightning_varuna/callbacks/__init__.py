"""Lightning callbacks of lightning-varuna."""

from lightning_varuna.callbacks.morph import MorphCallback
from lightning_varuna.callbacks.pipeline_trace import PipelineTrace

__all__ = ["MorphCallback", "PipelineTrace"]
