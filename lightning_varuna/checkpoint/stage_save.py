"""A Lightning checkpoint of one pipeline stage taken apart for a sharded save (`ShardedCheckpoints.save`): the
tensors each rank writes (its stage's model and optimizer state) and the training state that rank 0 writes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_varuna.checkpoint.state import OPTIMIZER_PARAMETER_NAMES

__all__ = ["split_stage_checkpoint"]

GroupNames = list[list[list[str]]]  # the names of each optimizer's parameters, group by group


def split_stage_checkpoint(
    checkpoint: dict[str, Any],
    optimizers: list[Optimizer],
    parameter_names: GroupNames,
    device: torch.device,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``checkpoint`` (Lightning's, of this stage) as its tensors (``model``, and ``optimizer`` by index) and the rest.

    With optimizer states, the rest keeps ``parameter_names`` (the whole model's optimizer parameters, group by
    group: `OPTIMIZER_PARAMETER_NAMES`) if every stage's ``optimizers`` still have the groups they were recorded
    with. Collective when there are optimizer states.
    """
    lightning_state = dict(checkpoint)
    tensors: dict[str, Any] = {"model": lightning_state.pop("state_dict")}
    optimizer_states = lightning_state.pop("optimizer_states", None)
    if optimizer_states is not None:
        tensors["optimizer"] = {str(i): state for i, state in enumerate(optimizer_states)}
        if _groups_as_recorded(optimizers, parameter_names, device):
            lightning_state[OPTIMIZER_PARAMETER_NAMES] = parameter_names
    return tensors, lightning_state


def _groups_as_recorded(optimizers: list[Optimizer], parameter_names: GroupNames, device: torch.device) -> bool:
    """Whether every stage's optimizers have as many groups as when the whole model's names were recorded (a
    callback may have added one on the stages holding its parameters since, BaseFinetuning aside). Collective."""
    counts = [len(optimizer.param_groups) for optimizer in optimizers]
    same = torch.tensor(int(counts == [len(groups) for groups in parameter_names]))
    same = same.to(device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())
