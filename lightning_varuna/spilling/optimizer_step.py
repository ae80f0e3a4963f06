"""One optimizer step of a spilled model, from Lightning's closure to the last shard stepped.

Lightning's precision plugin steps an optimizer by handing it a closure (the training step, its backward, then the
clipping request) and calling ``step``; fp16's calls the closure itself and ``step()`` after, unless it found an inf.
A spilled model's optimizer steps its shards in one of two places, which the step decides when it begins:

- in the closure's backward, each shard as soon as its gradients are complete, while it is on the device
  (``in_backward``: nothing reads the gradients of every shard between the backward and the step);
- in ``step()``, shard by shard after the closure: clipped by the norm over all shards if clipping was requested,
  and also when no backward ran (a training step that returned None), on the gradients accumulated before, as
  torch's optimizer steps whatever a closure leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_varuna.spilling.grad_scaler import ShardwiseGradScaler
from lightning_varuna.spilling.shards import ShardedModel

__all__ = ["ShardwiseStep"]


class ShardwiseStep:
    """The user's optimizer as Lightning's precision plugin steps it, for one step of a spilled model: ``step`` runs
    the closure and steps the shards its backward did not step. Everything else is the user's optimizer's.

    Args:
        optimizer: the user's optimizer.
        model: the spilled model it steps.
        in_backward: step each shard in the backward that completes its gradients.
        scaler: fp16's grad scaler, whose ``unscale_`` also counts the spilled gradients the backward unscaled.
    """

    # A fused optimizer unscales the gradients it is given, which fp16's grad scaler then leaves to it: not those
    # of the spilled shards, which the scaler unscales itself.
    _step_supports_amp_scaling = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: ShardedModel,
        in_backward: bool,
        scaler: ShardwiseGradScaler | None = None,
    ) -> None:
        self.optimizer, self.model = optimizer, model
        self.in_backward, self.scaler = in_backward, scaler
        self.stepped_in_backward = False
        self.ran = False  # `step` ran (fp16's grad scaler skips it after an inf, or if the closure ran no backward)
        self._clip: Callable[[list[nn.Parameter], Tensor], None] | None = None
        # As `GradScaler.unscale_`, the fp16 backward unscales only the optimizer's parameters.
        self._trained = {p for group in optimizer.param_groups for p in group["params"]}
        if scaler is not None:
            scaler.forget_spilled()

    def backward(self) -> AbstractContextManager[None]:
        """The closure's backward (`ShardedModel.backward`; the block backpropagates the loss through the last
        shard): each shard steps in it if this step steps there (once), or is unscaled for fp16's grad scaler."""
        stepping = self.in_backward and not self.stepped_in_backward
        self.stepped_in_backward = self.stepped_in_backward or stepping
        return self.model.backward(
            self.optimizer if stepping else None, self._unscale if self.scaler is not None else None
        )

    def clip_by_norm(self, max_norm: float) -> None:
        """Clip the gradients of every shard as they step, by their norm over all shards (Lightning's request)."""
        self._clip = lambda params, total: torch.nn.utils.clip_grads_with_norm_(_with_grads(params), max_norm, total)

    def clip_by_value(self, value: float) -> None:
        """Clip each gradient to ``[-value, value]`` as its shard steps (Lightning's request); a shard without
        gradients (frozen, or its weights tied to another's) has none to clip."""

        def clip(params: list[nn.Parameter], total: Any) -> None:
            if grads := _with_grads(params):
                torch.nn.utils.clip_grad_value_(grads, value)

        self._clip = clip

    def step(self, closure: Any = None) -> Any:
        """Run ``closure``, then step the shards its backward did not step."""
        self.ran = True
        result = closure() if closure is not None else None
        if not self.stepped_in_backward:
            self.model.step(self.optimizer, self._clip)
        return result

    def _unscale(self, params: list[nn.Parameter]) -> None:
        assert self.scaler is not None
        self.scaler.unscale_shard([p for p in params if p in self._trained])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _with_grads(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.grad is not None]
