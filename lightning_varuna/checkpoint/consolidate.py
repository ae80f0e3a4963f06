"""Turn a sharded checkpoint into one plain Lightning checkpoint, usable without this package."""

from __future__ import annotations

from typing import Any

from lightning_varuna.checkpoint.layout import open_complete
from lightning_varuna.checkpoint.sharded import read_tensors, read_training_state
from lightning_varuna.checkpoint.state import OPTIMIZER_PARAMETER_NAMES, empty_like_entry, optimizer_state_by_position
from lightning_varuna.storage import Storage

__all__ = ["RUN_SHAPE", "consolidate"]

RUN_SHAPE = "run_shape"
"""The key under which a consolidated checkpoint keeps the shape of the run that wrote it (`run_shape`: where it was in
its data, its global batch), which the strategies resume from as from the checkpoint's folder."""


def consolidate(url: str, storage: Storage | None = None) -> dict[str, Any]:
    """The whole checkpoint at ``url`` as one Lightning checkpoint dict, read in this process.

    ``state_dict`` holds every tensor of the model (``Model.load_from_checkpoint`` and ``load_state_dict``
    take it as is); the training state (epoch, step, loops, LR schedulers, callbacks, hyper-parameters) is kept,
    with the optimizer state numbered as torch numbers it (``optimizer_states``: a plain Trainer resumes from it;
    older checkpoints, and optimizers with a group of no parameters, keep it by parameter name under
    ``optimizer_states_by_name``), and the run's shape (its position in the data) under ``RUN_SHAPE``.
    `VarunaStrategy` and `SpillingStrategy` resume from it where they would from ``url``.
    """
    storage = storage or Storage()
    info = open_complete(storage, url)
    reader = storage.dcp_reader(info.version_url)
    metadata = reader.read_metadata()
    tensors: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        *parents, leaf = metadata.planner_data[key]
        node = tensors
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = empty_like_entry(entry)
    read_tensors(reader, tensors)
    checkpoint = {**read_training_state(storage, info), "state_dict": tensors["model"]}
    checkpoint[RUN_SHAPE] = info.shape
    group_names = checkpoint.pop(OPTIMIZER_PARAMETER_NAMES, None) or []
    if "optimizer" in tensors:
        # (no "state" before the first step: a checkpoint stores no empty dict)
        by_name = [{"state": {}, **tensors["optimizer"][i]} for i in sorted(tensors["optimizer"], key=int)]
        by_position = [optimizer_state_by_position(saved, groups) for saved, groups in zip(by_name, group_names)]
        if len(by_position) == len(by_name) and all(by_position):
            checkpoint["optimizer_states"] = by_position
        else:  # saved before the order was kept, or with a group of no saved parameters
            checkpoint["optimizer_states_by_name"] = by_name
    return checkpoint
