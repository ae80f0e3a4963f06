"""DataLoaders of a sweep's model that draw from torch's global generator while holding the model's own generator
state (see `DeviceScheduler`), so that they draw what they would draw alone: the seed a DataLoader without a
``generator`` draws as each iteration starts and, where its batches are read in the model's thread
(``num_workers=0``), what its dataset draws (random augmentations). A loader whose first batch drew nothing reads
the next ones without a hold, so that it does not wait while other models hold the generator."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_varuna.pipeline.replay import generator_states, states_differ

__all__ = ["ResumedEpoch", "draw_holding"]

Held = Callable[[], AbstractContextManager[Any]]

_CPU = torch.device("cpu")  # whose generator a dataset read in this process draws from
_SUBCLASSES: dict[tuple[type, str], type] = {}  # (a class, a method's name) -> the class with that method held


class _Draws:
    """Whether a loader's batches draw from torch's generator: unknown (None) until its first batch is read."""

    batches: bool | None = None


@dataclass
class ResumedEpoch:
    """Of a fit resumed from a checkpoint, until its first training batch (``active``): the training iterations it
    starts then that count, as the uninterrupted fit's draws. At an epoch resumed mid-way none does: the uninterrupted
    fit had started that epoch before the checkpoint. At an epoch's start, the last one does: Lightning may start
    one more than the uninterrupted fit did (as it sets up the data, and again as the epoch starts)."""

    mid_epoch: bool
    active: bool = True


def draw_holding(loader: DataLoader, held: Held, resumed: ResumedEpoch | None = None) -> DataLoader:
    """A copy of ``loader`` (which other models may share) that starts its iterations, and reads its batches if it
    reads them in this process, inside ``held()`` (a hold of the model's generator); a training loader of a fit
    resumed from a checkpoint starts its iterations before the first batch as ``resumed`` says (the seed each
    draws)."""
    own = copy.copy(loader)
    own.__class__ = _held(type(loader), "__iter__")
    own.holding_the_generator, own.draws, own.resumed, own.before_last = held, _Draws(), resumed, None
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
        resumed = self.resumed if self.resumed is not None and self.resumed.active else None
        mid_epoch = resumed is not None and resumed.mid_epoch
        with self.holding_the_generator(), torch.random.fork_rng(devices=[], enabled=mid_epoch):
            if resumed is not None and not mid_epoch:  # the one this loader started before does not count
                if self.before_last is not None:
                    torch.set_rng_state(self.before_last)
                self.before_last = torch.get_rng_state()
            iterator = method(self)
        if self.num_workers == 0:
            iterator.__class__ = _held(type(iterator), "__next__")
            iterator.holding_the_generator, iterator.draws = self.holding_the_generator, self.draws
        return iterator

    return __iter__


def _held_next(method: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __next__(self: Any) -> Any:
        if self.draws.batches is False:
            return method(self)
        with self.holding_the_generator():
            before = generator_states(_CPU)
            try:
                return method(self)
            finally:
                if self.draws.batches is None:
                    self.draws.batches = states_differ(before, generator_states(_CPU))

    return __next__
