"""Look ahead at what a run will do (its first batch, its step up to the forward) without changing the random numbers
it then draws."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

__all__ = ["global_random_states_kept"]


@contextmanager
def global_random_states_kept(device: torch.device | None = None) -> Iterator[None]:
    """Inside, code may draw from torch's (CPU, and ``device``'s if a CUDA device), Python's and NumPy's global
    generators; after, they are as before."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
