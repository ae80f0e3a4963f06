"""Trace a model again for each new input shape and train/eval mode: what one trace holds fixed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["Traces", "trace_key", "tracing_own_forward"]

T = TypeVar("T")

KEPT_TRACES = 8  # the traces a model keeps, the least recently used dropped first


class Traces(Generic[T]):
    """A model's traces by `trace_key`, at most `KEPT_TRACES` (inputs holding a value that is not a tensor and
    changes at every step would otherwise keep a trace each); the first trace made for a new such value alone warns
    of it, once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._traces: OrderedDict[tuple, T] = OrderedDict()
        self._warned = False

    def get(self, key: tuple, trace: Callable[[], T]) -> T:
        """The trace for ``key``, made by ``trace()`` if there is none."""
        if key in self._traces:
            self._traces.move_to_end(key)
            return self._traces[key]
        changed = None if self._warned else next(filter(None, (_changed_values(key, k) for k in self._traces)), None)
        if changed:
            self._warned = True
            rank_zero_warn(
                f"{self.name} is traced again because a value in its inputs that is not a tensor changed ({changed}): "
                "a trace holds such values fixed, so each new one costs a trace. Pass only tensors (and values that "
                "stay the same) to the model's forward: take the others out of the batch in `training_step`."
            )
        self._traces[key] = value = trace()
        while len(self._traces) > KEPT_TRACES:
            self._traces.popitem(last=False)
        return value


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


class _Value(NamedTuple):
    """What a trace key holds of an input that is not a tensor: its ``repr``."""

    text: str


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device.type)
    return _Value(repr(leaf))


def _changed_values(key: tuple, kept: tuple) -> str | None:
    """If ``key`` differs from ``kept`` only in values that are not tensors: the first such change, shortened."""
    if len(key) != len(kept) or key[0] != kept[0]:
        return None
    changes = [(a, b) for a, b in zip(key[1:], kept[1:]) if a != b]
    if not changes or not all(isinstance(a, _Value) and isinstance(b, _Value) for a, b in changes):
        return None
    now, before = changes[0]
    return f"{_short(before.text)} before, {_short(now.text)} now"


def _short(text: str, length: int = 40) -> str:
    return text if len(text) <= length else text[: length - 3] + "..."
