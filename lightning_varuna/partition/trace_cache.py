"""Trace a model again for each new input shape and train/eval mode: what one trace holds fixed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["trace_key", "tracing_own_forward"]


def trace_key(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a trace of ``module(*args, **kwargs)`` is specialized on: the mode of each of its modules (a BatchNorm a
    hook put in eval mode while the rest trains) and every input's shape and dtype."""
    modes = tuple(m.training for m in module.modules())
    return (modes, *(_leaf_key(leaf) for leaf in tree_leaves((args, kwargs))))


@contextmanager
def tracing_own_forward(module: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Set up a trace of the model's own forward (not one a running step patched onto the instance), with
    gradients on, on copies of the inputs; yields the copies."""
    patched = module.__dict__.pop("forward", None)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, (args, kwargs))
    finally:
        if patched is not None:
            module.forward = patched


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device.type)
    return repr(leaf)
