"""Look ahead at what a run will do (its first batch, its step up to the forward) without changing the random numbers
it then draws, nor what its step changes of its module's own state."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import lightning.pytorch as pl
import numpy as np
import torch

__all__ = ["global_random_states_kept", "step_state_kept"]

_PLAIN = (int, float, bool, str, type(None))


@contextmanager
def global_random_states_kept(device: torch.device | None = None) -> Iterator[None]:
    """Inside, code may draw from torch's (CPU, and ``device``'s if a CUDA device), Python's and NumPy's global
    generators; after, they are as before."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@contextmanager
def step_state_kept(module: pl.LightningModule) -> Iterator[None]:
    """Inside, a step may change what a step's own code often changes: its module's plain attributes (numbers and
    strings; the contents of its public lists and dicts; public attributes it adds) and its optimizers'
    hyperparameters (a learning rate scaled by hand); after, they are as before."""
    attributes, framework = vars(module), _lightning_module_attributes()
    plain = {n: value for n, value in attributes.items() if isinstance(value, _PLAIN) and n not in framework}
    contents = {  # each with a copy of what it holds
        name: (value, copy.copy(value))
        for name, value in attributes.items()
        if type(value) in (list, dict) and not name.startswith("_")
    }
    before = set(attributes)
    optimizers = module.trainer.optimizers
    groups = [[{k: _copied(v) for k, v in g.items() if k != "params"} for g in o.param_groups] for o in optimizers]
    try:
        yield
    finally:
        for name in [name for name in attributes if name not in before and not name.startswith("_")]:
            del attributes[name]
        attributes.update(plain)
        for name, (container, held) in contents.items():
            container.clear()
            (container.extend if isinstance(container, list) else container.update)(held)
            attributes[name] = container
        for optimizer, saved in zip(optimizers, groups):
            for group, hyperparameters in zip(optimizer.param_groups, saved):
                for key, value in hyperparameters.items():
                    if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                        group[key].copy_(value)  # in place: a scheduler may hold it
                    else:
                        group[key] = value


@cache
def _lightning_module_attributes() -> frozenset[str]:
    """The attributes every LightningModule has (torch's and Lightning's own, such as ``training``): not the step's."""
    return frozenset(vars(pl.LightningModule()))


def _copied(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)
