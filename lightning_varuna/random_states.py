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
def global_random_states_kept() -> Iterator[None]:
    """Inside, code may draw from torch's (CPU), Python's and NumPy's global generators; after, they are as before."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
