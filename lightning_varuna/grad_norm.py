"""Lightning's ``grad_norm``, also over the gradients that `SpillingStrategy` keeps spilled."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn

from lightning_varuna.spilling.spilled_grad_norms import SpilledGradNorms

__all__ = ["grad_norm"]


def grad_norm(module: pl.LightningModule, norm_type: float | str = 2, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and their total, named and computed as `lightning.pytorch.utilities.grad_norm`
    does: the same under any strategy, and under `SpillingStrategy` also for the spilled parameters, whose gradients
    are not in ``.grad``. Call it in ``on_before_optimizer_step``, as Lightning's. Of a model in spilled shards only
    the 2-norm (the default) is kept: another ``norm_type`` is refused then (a model that fits its budget in one
    shard takes any).

    Example::

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(lightning_varuna.grad_norm(self))
    """
    strategy = module._trainer.strategy if module._trainer is not None else None
    spilled: dict[nn.Parameter, Tensor] = {}
    if isinstance(strategy, SpilledGradNorms):
        spilled = strategy.spilled_grad_norms()
    if not spilled:
        return lightning_grad_norm(module, norm_type, group_separator)  # type: ignore[return-value]  # tensors
    if float(norm_type) != 2.0:
        raise ValueError(
            f"`grad_norm(norm_type={norm_type!r})`: SpillingStrategy keeps the 2-norm of each spilled gradient only. "
            "Use `norm_type=2`."
        )
    norms = {}
    for name, p in module.named_parameters():
        norm = spilled[p] if p in spilled else p.grad.data.norm(2) if p.grad is not None else None
        if norm is not None:
            norms[f"grad_2.0_norm{group_separator}{name}"] = norm
    norms["grad_2.0_norm_total"] = torch.tensor(list(norms.values())).norm(2)  # as Lightning's total
    return norms
