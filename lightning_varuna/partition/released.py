"""A model whose other stages' tensors a pipeline stage released says so where it is used whole: calling a submodule
that lost its tensors raises an error that says what to do instead of torch's ``NoneType`` error, and its
``state_dict`` warns that it lacks them, where it would otherwise be saved incomplete without a word."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["guard_released", "stage_state_dicts"]

_stage_state_dicts_wanted = False


@contextmanager
def stage_state_dicts() -> Iterator[None]:
    """Within: a ``state_dict`` of a released model is taken on purpose (a stage's checkpoint), without a warning."""
    global _stage_state_dicts_wanted
    wanted, _stage_state_dicts_wanted = _stage_state_dicts_wanted, True
    try:
        yield
    finally:
        _stage_state_dicts_wanted = wanted


def guard_released(module: nn.Module, released: dict[str, list[str]], held: str) -> None:
    """Guard ``module`` after the tensors in ``released`` (FQN of a submodule -> names of its parameters and buffers
    now ``None``) were dropped from it. ``held``: what this process keeps, such as "stage 1 of 2"."""
    example = next((f"{owner}.{names[0]}" if owner else names[0] for owner, names in released.items()), "")
    for owner_name, names in released.items():
        owner = module.get_submodule(owner_name)
        owner.register_forward_pre_hook(_refuse_call(owner_name or type(module).__name__, names, held))
        owner.register_state_dict_pre_hook(_warn_incomplete(names, held, example))  # one message: warned once


def _missing(owner: nn.Module, names: list[str]) -> list[str]:
    return [n for n in names if owner._parameters.get(n, owner._buffers.get(n)) is None]


def _refuse_call(owner_name: str, names: list[str], held: str) -> Any:
    def refuse(owner: nn.Module, args: Any) -> None:
        # While the strategy traces, stand-ins fill them; while it runs a step, the `self(...)` of the step runs the
        # stage in place of the module's forward.
        missing = _missing(owner, names) if "forward" not in owner.__dict__ else []
        if missing:
            raise RuntimeError(
                f"`{owner_name}` runs without its tensors {missing}: VarunaStrategy cut this model into pipeline "
                f"stages and this process holds only {held}'s; another process held these. Validate, test or "
                "predict after `fit` with the same Trainer (it runs the pipeline), and for anything else (another "
                "Trainer, another `fit`, using the model yourself) read the whole trained model from a checkpoint: "
                "`lightning-varuna consolidate CHECKPOINT model.ckpt`, then `YourModel.load_from_checkpoint("
                '"model.ckpt")` (docs/troubleshooting.md).'
            )

    return refuse


def _warn_incomplete(names: list[str], held: str, example: str) -> Any:
    def warn(owner: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not _stage_state_dicts_wanted and _missing(owner, names):
            warnings.warn(
                f"This `state_dict` lacks tensors of the model (such as `{example}`): VarunaStrategy cut it into "
                f"pipeline stages and this process holds only {held}'s. Read the whole trained model from a "
                "checkpoint (`lightning-varuna consolidate CHECKPOINT model.ckpt`; docs/troubleshooting.md).",
                stacklevel=2,
            )

    return warn
