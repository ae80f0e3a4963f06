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
    """Make ``obj.<name>(*args, **kwargs)`` call ``run(own hook, *args, **kwargs)`` until `restore_hooks`. The own hook
    is the one ``obj`` has now: a function set on the instance (``model.on_train_epoch_end = ...``) included."""
    setattr(obj, name, _Wrapped(run, getattr(obj, name), vars(obj).get(name)))


def restore_hooks(obj: object) -> None:
    """Give ``obj`` its own hooks back (after `wrap_hook`): those of its class, or those set on the instance."""
    for name, wrapped in [(name, value) for name, value in vars(obj).items() if isinstance(value, _Wrapped)]:
        own = wrapped.own
        while isinstance(own, _Wrapped):  # wrapped twice
            own = own.own
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


class _Wrapped:
    """An object's own hook, run by ``run(hook, *args, **kwargs)``; ``own``: the instance's attribute it replaced."""

    def __init__(self, run: Callable[..., Any], hook: Callable[..., Any], own: Any) -> None:
        self.run, self.hook, self.own = run, hook, own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.hook, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Wrapped:
        return self
