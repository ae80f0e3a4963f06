"""DataLoaders of a sweep's model that draw from torch's global generator while holding the model's own generator
state (see `DeviceScheduler`), so that they draw what they would draw alone: the seed a DataLoader without a
``generator`` draws as each iteration starts and, where its batches are read in the model's thread
(``num_workers=0``), what its dataset draws (random augmentations)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["draw_holding"]

Held = Callable[[], AbstractContextManager[Any]]

_SUBCLASSES: dict[tuple[type, str], type] = {}  # (a class, a method's name) -> the class with that method held


def draw_holding(loader: DataLoader, held: Held) -> None:
    """Make ``loader`` start its iterations, and read its batches if it reads them in this process, inside
    ``held()`` (a hold of the model's generator)."""
    loader.__class__ = _held(type(loader), "__iter__")
    loader.holding_the_generator = held


def _held(cls: type, name: str) -> type:
    """``cls`` with its method ``name`` run inside the instance's ``holding_the_generator()``; where ``name`` is
    ``"__iter__"``, an iterator that reads batches in this process also reads each one so."""
    if (cls, name) in _SUBCLASSES:
        return _SUBCLASSES[(cls, name)]
    method = getattr(cls, name)

    def held(self: Any) -> Any:
        hold = getattr(self, "holding_the_generator", None)
        if hold is None:  # a copy that Lightning made of the loader: as before
            return method(self)
        with hold():
            result = method(self)
        if name == "__iter__" and self.num_workers == 0:
            result.__class__ = _held(type(result), "__next__")
            result.holding_the_generator = hold
        return result

    subclass = type(cls.__name__, (cls,), {name: held, "__qualname__": cls.__qualname__, "__module__": cls.__module__})
    return _SUBCLASSES.setdefault((cls, name), subclass)
