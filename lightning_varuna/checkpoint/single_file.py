"""A single-file Lightning checkpoint (what ``Trainer(strategy="auto")`` writes on one device), read by one pipeline
stage: so that a run started on one device continues pipelined."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_varuna._lightning_private import parse_configure_optimizers
from lightning_varuna.checkpoint.state import TensorsByName, stage_tensors
from lightning_varuna.partition.skeleton import ModelSkeleton

__all__ = ["stage_checkpoint"]


def stage_checkpoint(
    checkpoint: dict[str, Any], module: pl.LightningModule, skeleton: ModelSkeleton, optimizers: list[Optimizer]
) -> dict[str, Any]:
    """``checkpoint`` (the whole model's) as `ShardedCheckpoints.load` gives a stage its part: ``state_dict`` the
    entries of the stage ``module``'s state dict, ``optimizer_states`` the state of its ``optimizers`` by name.

    torch numbers an optimizer's parameters by their position in it, and the optimizers the stage's
    ``configure_optimizers`` made hold only the stage's parameters: the positions in the whole model's optimizers
    come from running ``configure_optimizers`` again with every parameter in place (as memory-free stand-ins).
    """
    with skeleton.stand_ins(module):
        returned: Any = module.configure_optimizers()
        saved = TensorsByName(checkpoint, module, parse_configure_optimizers(returned)[0] if returned else [])
    training_state = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    return {**training_state, **stage_tensors(saved, module, optimizers)}
