"""lightning-varuna: pipeline x data parallel training of LightningModules sliced at CutPoints."""

import warnings

from lightning_varuna.callbacks import MorphCallback, PipelineTrace
from lightning_varuna.cutpoint import CutPoint, cut_after
from lightning_varuna.grad_norm import grad_norm
from lightning_varuna.multimodel import MultiModelTrainer
from lightning_varuna.strategies import SpillingStrategy, VarunaStrategy

__all__ = [
    "CutPoint",
    "MorphCallback",
    "MultiModelTrainer",
    "PipelineTrace",
    "SpillingStrategy",
    "VarunaStrategy",
    "cut_after",
    "grad_norm",
]
__version__ = "0.1.0"

# torch >= 2.10 deprecates `isinstance(spec, LeafSpec)`, which Lightning 2.6's own pytree helper and the unpickling of
# a TreeSpec (every object sent between stages that holds one) still do: a screen of warnings no user can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
