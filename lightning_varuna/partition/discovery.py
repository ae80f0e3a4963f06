"""Find the CutPoints a forward pass goes through and check each call."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_varuna.cutpoint import CutPoint
from lightning_varuna.data.microbatch import batch_size_of
from lightning_varuna.partition.tracing import kv_cache_configs, without_kv_cache

__all__ = ["buffers_kept", "discover_cutpoints", "observe_cutpoints"]


@contextmanager
def observe_cutpoints(
    module: nn.Module, batch_size: int, on_call: Any = None, only: Collection[str] | None = None
) -> Iterator[list[str]]:
    """Record the names of the cutpoints called during a forward, checking each call's input; ``on_call(x)`` runs
    at each (a tensor it returns goes on in ``x``'s place). With ``only`` (`discover_cutpoints`'s list), the
    others are not observed: a segment's measurement then ends where the stage or shard it belongs to ends."""
    names = {
        cut: name
        for name, cut in module.named_modules()
        if isinstance(cut, CutPoint) and (only is None or name in only)
    }
    order: list[str] = []

    def observe(cut: CutPoint, x: object) -> Tensor | None:
        name = names[cut]
        if name in order:
            raise ValueError(
                f"CutPoint `{name}` was called twice in one forward. Each CutPoint marks one place: "
                "create one CutPoint instance per call site (e.g. one per block in an `nn.ModuleList`). If it sits "
                "in a module the forward calls more than once (a layer whose weights are shared between depths, as "
                "in ALBERT), put the CutPoints outside that module, between its calls."
            )
        if not isinstance(x, Tensor):
            raise TypeError(
                f"CutPoint `{name}` got a value of type `{type(x).__name__}`; its input must be one tensor whose "
                "dim 0 is the batch. Move the CutPoint to where a single activation tensor flows between blocks."
            )
        if x.dim() == 0 or x.shape[0] != batch_size:
            raise ValueError(
                f"CutPoint `{name}` got a tensor of shape {tuple(x.shape)}, but the batch the forward was run with "
                f"has {batch_size} rows (dim 0 of its first tensor): a CutPoint's input must keep the batch as dim 0 "
                "(move it to where the activation is batch-first, not transposed or flattened across the batch)."
            )
        order.append(name)
        return None if on_call is None else on_call(x)

    for cut in names:
        cut._observer = observe
    try:
        yield order
    finally:
        for cut in names:
            cut._observer = None


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Put every buffer back as it was after the block: passes that only look at the model (finding the CutPoints,
    timing the segments) must not move BatchNorm's running statistics, or the trained model differs from one
    device's. (Buffers still on the meta device hold nothing to keep.)"""
    saved = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def discover_cutpoints(module: nn.Module, args: tuple, kwargs: dict | None = None) -> list[str]:
    """Run one forward without gradients and return the names of the cutpoints it went through, in order.

    A CutPoint whose output is the forward's output (``cut_after`` on every layer of a model that ends with its last
    layer) has no work after it: it cannot begin a stage or a shard, and is left out."""
    seen: list[Tensor] = []
    with (
        torch.no_grad(),
        buffers_kept(module),
        without_kv_cache(kv_cache_configs(module)),
        observe_cutpoints(module, batch_size_of((args, kwargs)), seen.append) as order,
    ):
        output = module(*args, **(kwargs or {}))
    last = order.pop() if order and output is seen[-1] else None  # called, with nothing after it
    uncalled = [n for n, m in module.named_modules() if isinstance(m, CutPoint) and n not in order and n != last]
    if uncalled:
        rank_zero_warn(
            f"{', '.join(f'`{name}`' for name in uncalled)}: CutPoint(s) that `{type(module).__name__}.forward` "
            "never calls, so the model is never cut there. Put them where the forward calls them (with `cut_after`: "
            "after modules the forward runs), or remove them."
        )
    return order
