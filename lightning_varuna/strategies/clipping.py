"""Lightning's gradient clipping, routed to a strategy's own.

``Trainer(gradient_clip_val=...)`` and ``LightningModule.clip_gradients`` end in the precision plugin's
``clip_grad_by_norm`` / ``clip_grad_by_value``, which clip the parameters this process holds as if they were the
whole model, and Lightning has no strategy hook for clipping. A pipeline stage or a spilled shard holds part of the
model, so the strategies replace those methods on their plugin instance. Not by a subclass or a wrapper: Lightning
saves the plugin's state in checkpoints under its class name, and callbacks (``ThroughputMonitor``) check its class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import Precision

__all__ = ["route_gradient_clipping"]

Clip = Callable[[Any, float], None]  # (optimizer, clip value)


def route_gradient_clipping(precision: Precision, by_norm: Clip, by_value: Clip | None = None) -> None:
    """Make Lightning's clipping by norm (and by value, if given) call ``by_norm`` (``by_value``)."""
    precision.clip_grad_by_norm = by_norm  # type: ignore[method-assign,assignment]
    if by_value is not None:
        precision.clip_grad_by_value = by_value  # type: ignore[method-assign,assignment]
