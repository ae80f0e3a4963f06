"""DataLoaders of a sweep's model that draw from torch's global generator while holding the model's own generator
state (see `DeviceScheduler`), so that they draw what they would draw alone: the seed a DataLoader without a
``generator`` draws as each iteration starts and, where its batches are read in the model's thread
(``num_workers=0``), what its dataset draws (random augmentations). A loader whose first batch drew nothing reads
the next ones without a hold, so that it does not wait while other models hold the generator."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_varuna.pipeline.replay import generator_states, states_differ

__all__ = ["draw_holding"]

Held = Callable[[], AbstractContextManager[Any]]

_CPU = torch.device("cpu")  # whose generator a dataset read in this process draws from
_SUBCLASSES: dict[tuple[type, str], type] = {}  # (a class, a method's name) -> the class with that method held


class _Draws:
    """Whether a loader's batches draw from torch's generator: unknown (None) until its first batch is read."""

    batches: bool | None = None


def draw_holding(loader: DataLoader, held: Held, resumed_mid_epoch: bool = False) -> DataLoader:
    """A copy of ``loader`` (which other models may share) that starts its iterations, and reads its batches if it
    reads them in this process, inside ``held()`` (a hold of the model's generator).

    ``resumed_mid_epoch``: its first iteration continues an epoch of a run resumed from a checkpoint, where the
    uninterrupted run had started it, and read the batch that comes first, before the checkpoint: what that start
    and that batch draw now leaves the model's state as it was, so that the next draws are the uninterrupted run's."""
    own = copy.copy(loader)
    own.__class__ = _held(type(loader), "__iter__")
    own.holding_the_generator, own.draws, own.resumed_mid_epoch = held, _Draws(), resumed_mid_epoch
    return own


def _held(cls: type, name: str) -> type:
    """``cls`` with its method ``name`` run inside the instance's ``holding_the_generator()``; where ``name`` is
    ``"__iter__"``, an iterator that reads batches in this process also reads them so while they draw."""
    if getattr(cls, "held_method", None) == name:  # held already
        return cls
    if (cls, name) not in _SUBCLASSES:
        method = getattr(cls, name)
        held = _held_iter(method) if name == "__iter__" else _held_next(method)
        attributes = {name: held, "held_method": name, "__qualname__": cls.__qualname__, "__module__": cls.__module__}
        _SUBCLASSES.setdefault((cls, name), type(cls.__name__, (cls,), attributes))
    return _SUBCLASSES[(cls, name)]


def _held_iter(method: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __iter__(self: Any) -> Any:
        resumed, self.resumed_mid_epoch = self.resumed_mid_epoch, False
        with self.holding_the_generator(), _kept_if(resumed):
            iterator = method(self)
        if self.num_workers == 0:
            iterator.__class__ = _held(type(iterator), "__next__")
            iterator.holding_the_generator, iterator.draws = self.holding_the_generator, self.draws
            iterator.resumed_mid_epoch = resumed
        return iterator

    return __iter__


def _held_next(method: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __next__(self: Any) -> Any:
        if self.draws.batches is False:
            return method(self)
        resumed, self.resumed_mid_epoch = self.resumed_mid_epoch, False
        with self.holding_the_generator(), _kept_if(resumed):
            before = generator_states(_CPU)
            try:
                return method(self)
            finally:
                if self.draws.batches is None:
                    self.draws.batches = states_differ(before, generator_states(_CPU))

    return __next__


def _kept_if(kept: bool) -> AbstractContextManager[Any]:
    """Inside, with ``kept``, what is drawn from torch's CPU generator is drawn again after."""
    return torch.random.fork_rng(devices=[]) if kept else nullcontext()
