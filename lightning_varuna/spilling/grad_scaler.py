"""fp16 loss scaling for a spilled model: torch's GradScaler, with the spilled gradients unscaled shard by shard.

`GradScaler.unscale_` unscales the gradients it finds on the optimizer's parameters, which a spilled model's
parameters do not hold between their turns. So the last backward before an optimizer step unscales each shard's
gradients while they are on the device, and ``unscale_`` reports what that found: an inf or NaN anywhere skips the
step and backs off the scale as for the model whole. (torch's ``ShardedGradScaler`` extends GradScaler the same way
for FSDP's sharded gradients.)
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn

from lightning_varuna._torch_private import unscale_and_find_inf

__all__ = ["ShardwiseGradScaler", "shardwise"]


class ShardwiseGradScaler(torch.amp.GradScaler):
    """A `torch.amp.GradScaler` whose ``unscale_`` also counts the gradients that `unscale_shard` unscaled, and
    what `note_found_inf` noted (VarunaStrategy's stages: what the other stages found)."""

    _spilled_found_inf: Tensor | None = None

    def unscale_shard(self, params: list[nn.Parameter]) -> None:
        """Unscale ``params``' gradients in place (a shard's, complete for this step), noting an inf or NaN."""
        if not self.is_enabled():
            return
        assert self._scale is not None, "the loss was not scaled before its backward"
        inv_scale = self._scale.double().reciprocal().float()  # as `GradScaler.unscale_` computes it
        if self._spilled_found_inf is None:
            self._spilled_found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None:
                if p.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")  # as `GradScaler.unscale_` refuses
                by_dtype[p.grad.dtype].append(p.grad)
        for grads in by_dtype.values():
            unscale_and_find_inf(grads, self._spilled_found_inf, inv_scale)

    def note_found_inf(self, found: Tensor) -> None:
        """Count ``found`` (1: an inf or NaN was found elsewhere, 0: none) in the next ``unscale_``: a pipeline
        stage notes what every stage found, so that all skip a step together, one holding no gradients too."""
        assert self._scale is not None, "the loss was not scaled before its backward"
        found = found.reshape(()).to(device=self._scale.device, dtype=torch.float32)
        self._spilled_found_inf = found if self._spilled_found_inf is None else self._spilled_found_inf + found

    def forget_spilled(self) -> None:
        """Forget what `unscale_shard` and `note_found_inf` found (a new step begins)."""
        self._spilled_found_inf = None

    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # the resident gradients
        spilled, self._spilled_found_inf = self._spilled_found_inf, None
        if spilled is not None:
            if spilled.device in per_device:
                per_device[spilled.device] += spilled
            else:
                per_device[spilled.device] = spilled
        return per_device


def shardwise(scaler: torch.amp.GradScaler) -> ShardwiseGradScaler:
    """Make ``scaler`` a ShardwiseGradScaler in place: the same object (a user's may be kept elsewhere), its settings,
    state and class (a user's subclass) kept, with ShardwiseGradScaler's methods added."""
    if type(scaler) is torch.amp.GradScaler:
        scaler.__class__ = ShardwiseGradScaler
    elif not isinstance(scaler, ShardwiseGradScaler):
        scaler.__class__ = type(f"Shardwise{type(scaler).__name__}", (ShardwiseGradScaler, type(scaler)), {})
    return scaler  # type: ignore[return-value]
