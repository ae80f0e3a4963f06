"""Run a hook of some of the trainer's callbacks inside a context of the strategy's, for one run.

Lightning's callbacks read the LightningModule as one device holds it. Where a process holds only part of the model
(spilled parameters, other stages'), a few of their hooks need the whole model's stand-ins around them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import lightning.pytorch as pl

from lightning_varuna.hook_wrapping import restore_hooks, wrap_hook

__all__ = ["callbacks_of", "restore_callback_hooks", "run_hook_inside"]


def callbacks_of(trainer: pl.Trainer, kinds: type | tuple[type, ...]) -> list[Any]:
    """The trainer's callbacks of these ``kinds``."""
    return [c for c in trainer.callbacks if isinstance(c, kinds)]  # type: ignore[attr-defined]


def run_hook_inside(
    trainer: pl.Trainer,
    kinds: type | tuple[type, ...],
    hook: str,
    context: Callable[[pl.LightningModule], AbstractContextManager[None]],
) -> None:
    """Make the ``hook`` of each callback of these ``kinds`` run inside ``context(pl_module)`` until
    `restore_callback_hooks`."""
    for callback in callbacks_of(trainer, kinds):
        wrap_hook(callback, hook, partial(_inside, context))


def restore_callback_hooks(trainer: pl.Trainer) -> None:
    """Give every callback its own hooks back (after `run_hook_inside`)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        restore_hooks(callback)


def _inside(
    context: Callable[[pl.LightningModule], AbstractContextManager[None]],
    hook: Callable[..., Any],
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    *args: Any,
    **kwargs: Any,
) -> Any:
    with context(pl_module):
        return hook(trainer, pl_module, *args, **kwargs)
