"""What SpillingStrategy requires of the device, the module, its optimizer and the trainer's callbacks.

A spilled parameter holds no values and no ``.grad`` between its shard's turns on the device: the callbacks that
would read every weight are refused, those that read gradients are told what they see, and each shard steps in its
own backward only where nothing reads the gradients of every shard between Lightning's backward and its optimizer
step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_varuna.checkpoint.state import parameter_group_names
from lightning_varuna.strategies.callback_hooks import callbacks_of
from lightning_varuna.strategies.optimizers import optimized_parameters, torch_optimizer
from lightning_varuna.strategies.requirements import (
    WEIGHT_AVERAGING,
    refuse_a_graph_of_the_whole_model,
    refuse_pruning_as_it_trains,
    require_automatic_optimization,
)

__all__ = [
    "check_callbacks_of_spilled_model",
    "check_module_to_spill",
    "one_optimizer",
    "shards_may_step_in_backward",
]


def check_module_to_spill(module: pl.LightningModule, device: torch.device) -> None:
    """Refuse a device other than the CPU or a CUDA GPU, manual optimization, and a module compiled whole."""
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"SpillingStrategy runs on the CPU or a CUDA GPU; `{device}` is not supported. "
            "Use `Trainer(accelerator='cpu')` or `'gpu'`."
        )
    require_automatic_optimization(
        module, "SpillingStrategy", "the forward and backward of `training_step` shard by shard"
    )
    if module._compiler_ctx is not None:
        raise ValueError(
            "SpillingStrategy cannot train a LightningModule compiled whole (`torch.compile(model)`): its forward "
            "runs shard by shard, over parameters that are spilled between their turns. Pass the module itself; "
            "compiling its parts inside it (`self.net = torch.compile(net)`) works."
        )


def one_optimizer(optimizers: list[Any], module: pl.LightningModule) -> Any:
    """The one optimizer of ``optimizers`` (None if there is none), over parameters of ``module``; several are
    refused."""
    if len(optimizers) > 1:
        raise ValueError("SpillingStrategy trains with one optimizer; `configure_optimizers` returned several.")
    parameter_group_names([torch_optimizer(o) for o in optimizers], module)  # raises for a parameter not the module's
    return optimizers[0] if optimizers else None


def check_callbacks_of_spilled_model(trainer: pl.Trainer, shards: int, optimizer: Any) -> None:
    """Refuse the callbacks that cannot train a model spilled in ``shards`` shards; tell the module and callbacks
    that read gradients before the step which they see."""
    _refuse_callbacks_reading_every_weight(trainer, shards)
    refuse_pruning_as_it_trains(trainer, f"SpillingStrategy runs the forward in {shards} shards")
    refuse_a_graph_of_the_whole_model(
        trainer,
        f"SpillingStrategy keeps the model spilled in {shards} shard(s), run only through `self(...)` in a step",
    )
    _refuse_finetuning_of_parameters_outside(trainer, optimizer)
    _note_spilled_gradients(trainer)


def shards_may_step_in_backward(trainer: pl.Trainer, loss_scaled: bool) -> bool:
    """Whether each shard may step as soon as its backward is done: nothing between Lightning's backward and its
    optimizer step needs every shard's gradients (no fp16 loss scaling, no gradient clipping, no
    ``on_before_optimizer_step``)."""
    return not (
        loss_scaled  # an fp16 overflow in any shard skips the step of every shard
        or trainer.gradient_clip_val
        or is_overridden("configure_gradient_clipping", trainer.lightning_module, pl.LightningModule)
        or _gradient_readers(trainer)
    )


def _gradient_readers(trainer: pl.Trainer) -> list[str]:
    """The module and callbacks with an ``on_before_optimizer_step``: it reads the gradients between the backward
    and the step."""
    module = trainer.lightning_module
    readers = [module] if is_overridden("on_before_optimizer_step", module, pl.LightningModule) else []
    readers += [c for c in trainer.callbacks if is_overridden("on_before_optimizer_step", c, pl.Callback)]  # type: ignore[attr-defined]
    return [type(reader).__name__ for reader in readers]


def _note_spilled_gradients(trainer: pl.Trainer) -> None:
    readers = _gradient_readers(trainer)
    if readers and trainer.state.fn == TrainerFn.FITTING:
        rank_zero_info(
            f"SpillingStrategy: the `on_before_optimizer_step` of {', '.join(f'`{r}`' for r in readers)} sees the "
            "gradients of the parameters on the device only: a spilled parameter holds no `.grad` there. "
            "`lightning_varuna.grad_norm(self)` gives every parameter's gradient norm (Lightning's `grad_norm` "
            "misses the spilled ones)."
        )


def _refuse_callbacks_reading_every_weight(trainer: pl.Trainer, shards: int) -> None:
    """Weight averaging (SWA, EMA) copies every parameter after each step, where spilled ones hold no elements."""
    averaging = callbacks_of(trainer, WEIGHT_AVERAGING)
    if averaging:
        raise ValueError(
            f"`{type(averaging[0]).__name__}` averages every parameter of the model after each step, but "
            f"SpillingStrategy keeps them spilled there ({shards} shard(s), not staying on the device). Give the model "
            "a `memory_budget` that holds it in one shard, or train it without the callback."
        )


def _refuse_finetuning_of_parameters_outside(trainer: pl.Trainer, optimizer: Any) -> None:
    """Lightning's `BaseFinetuning` finds the parameters it unfreezes among the optimizer's by their values, which
    spilled parameters do not hold: all would look alike."""
    finetuning = callbacks_of(trainer, BaseFinetuning)
    if not finetuning or optimizer is None:
        return
    held = {id(p) for p in optimized_parameters(optimizer)}
    if any(id(p) not in held for p in trainer.lightning_module.parameters()):
        raise ValueError(
            f"`{type(finetuning[0]).__name__}` would add the parameters it unfreezes to the optimizer, finding them "
            "by their values, which a spilled model's parameters do not hold. Build the optimizer over all of the "
            "model's parameters (`self.parameters()`): the frozen ones get no gradients and stay as they are."
        )
