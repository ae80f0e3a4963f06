"""Replace a hook of one object (a callback, the LightningModule) by a wrapper of its own hook, for one run.

The wrapper is an attribute of the instance, so it goes ahead of the class's hook; `restore_hooks` removes it. A
copy of the object (a callback's averaged copy of the module) shares the wrapper rather than copy what it refers to
(a strategy's process groups): Lightning runs the hooks of the trained objects only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["restore_hooks", "wrap_hook"]


def wrap_hook(obj: object, name: str, run: Callable[..., Any]) -> None:
    """Make ``obj.<name>(*args, **kwargs)`` call ``run(own hook, *args, **kwargs)`` until `restore_hooks`."""
    setattr(obj, name, _Wrapped(run, getattr(type(obj), name).__get__(obj)))


def restore_hooks(obj: object) -> None:
    """Give ``obj`` its own hooks back (after `wrap_hook`)."""
    for name in [name for name, value in vars(obj).items() if isinstance(value, _Wrapped)]:
        delattr(obj, name)


class _Wrapped:
    """An object's own hook, run by ``run(hook, *args, **kwargs)``."""

    def __init__(self, run: Callable[..., Any], hook: Callable[..., Any]) -> None:
        self.run, self.hook = run, hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.hook, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Wrapped:
        return self
