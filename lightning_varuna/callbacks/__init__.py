"""Lightning callbacks (layer 7): `MorphCallback` (SIGUSR1 and resource changes: checkpoint, stop, relaunch in a new
shape) and `PipelineTrace` (a training step's measured timeline); `optimizer_steps` tells the batch ends that
follow an optimizer step, where callbacks that save do so."""

from lightning_varuna.callbacks.morph import MorphCallback
from lightning_varuna.callbacks.pipeline_trace import PipelineTrace

__all__ = ["MorphCallback", "PipelineTrace"]
