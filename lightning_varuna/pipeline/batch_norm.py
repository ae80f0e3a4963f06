"""BatchNorm over micro-batches: it normalizes over a micro-batch's rows, so one row may be too few; and the running
statistics that each replica updates from its own micro-batches."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from lightning_varuna._torch_private import BatchNorm, NormWithRunningStats

__all__ = ["normalizes_over_the_batch", "one_value_per_channel_refused", "running_statistics"]


def normalizes_over_the_batch(module: nn.Module) -> bool:
    """Whether ``module`` has a BatchNorm, whose statistics are taken over the rows of a (micro-)batch."""
    return any(isinstance(m, BatchNorm) for m in module.modules())


@contextmanager
def one_value_per_channel_refused(module: nn.Module, advice: str) -> Iterator[None]:
    """Inside the block, a training BatchNorm given one value per channel (one row, and no spatial positions) fails
    with a message that names it and ends with ``advice`` (what to change), before torch's own error, which names
    neither the layer nor the micro-batch."""

    def check(norm: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        training = norm.training or (norm.running_mean is None and norm.running_var is None)
        if training and isinstance(x, Tensor) and x.dim() >= 2 and x.shape[0] * math.prod(x.shape[2:]) == 1:
            raise ValueError(
                f"`{names[norm]}` ({type(norm).__name__}) got an input of shape {tuple(x.shape)}: one value per "
                f"channel, from which batch normalization cannot train. {advice}"
            )

    names: dict[nn.Module, str] = {m: name for name, m in module.named_modules() if isinstance(m, BatchNorm)}
    handles = [norm.register_forward_pre_hook(check) for norm in names]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def running_statistics(module: nn.Module) -> list[Tensor]:
    """The buffers of ``module`` that training updates: the running statistics of its normalization layers
    (BatchNorm, InstanceNorm), not constant buffers such as a positional encoding."""
    return [
        buffer
        for norm in module.modules()
        if isinstance(norm, NormWithRunningStats)
        for buffer in norm.buffers(recurse=False)
        if buffer is not None
    ]
