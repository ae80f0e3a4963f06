"""What running a forward again needs (recomputing activations for backward): the same random numbers, the buffers as
the first run found them, which the replay may update without touching the model's (BatchNorm's running statistics,
a running mean, a counter), and the autocast and default dtype it ran in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "BufferState",
    "DtypeState",
    "RandomState",
    "default_dtype",
    "generator_states",
    "set_generator_states",
    "states_differ",
]


def generator_states(device: torch.device) -> list[torch.Tensor]:
    """The states of the generators that work on ``device`` draws from: torch's CPU generator, and a GPU's own."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_generator_states(states: list[torch.Tensor], device: torch.device) -> None:
    """Put the generators that work on ``device`` draws from in ``states`` (as `generator_states` took them)."""
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def states_differ(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    """Whether random numbers were drawn between two `generator_states`."""
    return any(not torch.equal(a, b) for a, b in zip(before, after))


@dataclass(frozen=True)
class DtypeState:
    """The dtypes a forward computes in on ``device_type``: autocast's, and torch's default dtype (the dtype of the
    tensors it makes, which a "true" precision sets while Lightning's step runs, and its backward does not)."""

    device_type: str
    autocast: bool
    autocast_dtype: torch.dtype
    default_dtype: torch.dtype

    @classmethod
    def current(cls, device_type: str) -> DtypeState:
        autocast = torch.is_autocast_enabled(device_type)
        return cls(device_type, autocast, torch.get_autocast_dtype(device_type), torch.get_default_dtype())

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block in these dtypes; the default dtype is restored afterwards."""
        with (
            default_dtype(self.default_dtype),
            torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast),
        ):
            yield


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype is ``dtype`` inside the block, and what it was before after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class RandomState:
    """The random number generators' state before a forward, to replay it (same dropout masks) on recompute."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states = generator_states(device)

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from this state; the generators continue afterwards as if it had not run."""
        gpus = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus):
            set_generator_states(self.states, self.device)
            yield


class BufferState:
    """The buffers of ``modules`` as a forward found them (copies), to replay it as it ran: a forward may read a
    buffer that it changes (a running mean, a step counter). Taken before the forward. Every buffer is copied: an
    operation may change one in place without a trace (BatchNorm's running statistics keep their version counter)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._buffers = [
            (owner, name, buffer.clone())
            for module in modules
            for owner in module.modules()
            for name, buffer in owner._buffers.items()
            if buffer is not None
        ]

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside the block the modules hold the copies: the replayed forward reads the buffers as the first run
        found them, and its own changes to them are dropped (the first run's stay)."""
        swapped = []
        for owner, name, copy in self._buffers:
            swapped.append((owner, name, owner._buffers[name]))
            owner._buffers[name] = copy
        try:
            yield
        finally:
            for owner, name, buffer in swapped:
                owner._buffers[name] = buffer
