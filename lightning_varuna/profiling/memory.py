"""Measure the activation memory autograd keeps for backward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["SavedTensorMeter"]


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward while `measuring`, counted once per storage.

    ``bytes`` is what is alive now (a saved tensor is released when its graph is freed by backward), ``peak``
    the most alive at once since the meter was made or ``reset``.
    """

    def __init__(self) -> None:
        self._live: dict[int, list[int]] = {}  # storage address -> [references, bytes]
        self.bytes = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = self.bytes

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Count what autograd saves inside the block (until it is released, even after the block)."""
        meter = self

        class Saved:
            def __init__(self, tensor: Tensor) -> None:
                storage = tensor.untyped_storage()
                self.tensor, self.key = tensor, storage.data_ptr()
                entry = meter._live.setdefault(self.key, [0, storage.nbytes()])
                if entry[0] == 0:
                    meter.bytes += entry[1]
                    meter.peak = max(meter.peak, meter.bytes)
                entry[0] += 1

            def __del__(self) -> None:
                entry = meter._live[self.key]
                entry[0] -= 1
                if entry[0] == 0:
                    meter.bytes -= entry[1]
                    del meter._live[self.key]

        with torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor):
            yield
