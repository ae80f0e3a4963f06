"""What code outside the strategies reads of a spilled model's gradients, whose spilled parameters hold no ``.grad``.

`lightning_varuna.grad_norm` reads them through this protocol, which `SpillingStrategy` implements, so that it
depends on the spilling layer and not on the strategy above it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn

__all__ = ["SpilledGradNorms"]


@runtime_checkable
class SpilledGradNorms(Protocol):
    """A strategy that keeps some of the model's gradients spilled (`SpillingStrategy`)."""

    def spilled_grad_norms(self) -> dict[nn.Parameter, Tensor]:
        """The 2-norm of each spilled parameter's gradient after the last backward."""
        ...
