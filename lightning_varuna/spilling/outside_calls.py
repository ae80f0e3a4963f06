"""A module whose parameters are spilled, run other than through the shards (``self.model.generate(...)``, ``self(...)``
in an epoch-end hook), fails naming it and what to do, not with torch's error about a parameter without elements."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["refuse_calls_while_spilled"]


def refuse_calls_while_spilled(model: nn.Module, spilled: list[nn.Parameter]) -> Callable[[], None]:
    """Make each submodule of ``model`` that holds one of ``spilled`` refuse to run while that parameter holds no
    elements (spilled; a stand-in put in its place for a trace runs). Returns what removes the checks."""
    ids = {id(p) for p in spilled}
    handles: list[RemovableHandle] = []
    for name, module in model.named_modules():
        if any(id(p) in ids for p in module._parameters.values()):
            handles.append(module.register_forward_pre_hook(_Refusal(name or type(model).__name__, ids)))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


class _Refusal:
    def __init__(self, name: str, spilled: set[int]) -> None:
        self.name, self.spilled = name, spilled

    def __call__(self, module: nn.Module, args: Any) -> None:
        if "forward" in module.__dict__:
            return  # the model called in a step, its forward replaced by the shards' (`patched_forward`)
        if any(p is not None and id(p) in self.spilled and p.numel() == 0 for p in module._parameters.values()):
            raise RuntimeError(
                f"`{self.name}` runs while its parameters are spilled: SpillingStrategy runs the model shard by shard "
                "only through `self(...)` inside `training_step`, `validation_step`, `test_step` and `predict_step`. "
                "Call the model there (an epoch-end hook can use what the steps computed), not a submodule directly "
                "(`self.model.generate(...)`); or give a `memory_budget` that holds the model in one shard."
            )
