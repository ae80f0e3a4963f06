"""What running a forward again needs (recomputing activations for backward): the same random numbers, and
buffers that the replay may update without touching the model's (BatchNorm's running statistics)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["RandomState", "scratch_buffers"]


class RandomState:
    """The random number generators' state before a forward, to replay it (same dropout masks) on recompute."""

    def __init__(self, device: torch.device) -> None:
        self._devices = [device] if device.type == "cuda" else []
        self.cpu_state = torch.get_rng_state()
        self._device_states = [torch.cuda.get_rng_state(d) for d in self._devices]

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from this state; the generators continue afterwards as if it had not run."""
        with torch.random.fork_rng(devices=self._devices):
            torch.set_rng_state(self.cpu_state)
            for device, state in zip(self._devices, self._device_states):
                torch.cuda.set_rng_state(state, device)
            yield


@contextmanager
def scratch_buffers(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Inside the block the ``modules`` hold copies of their buffers, so that a replayed forward leaves the real
    ones (already updated by the first run) alone; its autograd graph keeps the copies, which nothing changes."""
    swapped = []
    for module in modules:
        for owner in module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    swapped.append((owner, name, buffer))
                    owner._buffers[name] = buffer.clone()
    try:
        yield
    finally:
        for owner, name, buffer in swapped:
            owner._buffers[name] = buffer
