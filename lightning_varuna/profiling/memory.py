"""Measure the activation memory autograd keeps for backward."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["SavedTensorMeter"]


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward while `measuring`, counted once per storage.

    ``bytes`` is what is alive now (a saved tensor is released when its graph is freed by backward), ``peak``
    the most alive at once. Tensors whose storage is one of ``exclude`` (a model's parameters and buffers,
    which a matmul saves too) are not activations and are not counted.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._live: dict[int, list[int]] = {}  # storage address -> [references, bytes]
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.bytes = 0
        self.peak = 0

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Count what autograd saves inside the block (until it is released, even after the block)."""
        meter = self

        class Saved:
            def __init__(self, tensor: Tensor) -> None:
                storage = tensor.untyped_storage()
                # Detached: a saved output holding its own grad_fn would be a cycle that keeps the graph, and with
                # it every tensor it saved (the weights too), alive after the graph is dropped.
                self.tensor, self.key = tensor.detach(), storage.data_ptr()
                if self.key in meter._excluded:
                    return
                entry = meter._live.setdefault(self.key, [0, storage.nbytes()])
                if entry[0] == 0:
                    meter.bytes += entry[1]
                    meter.peak = max(meter.peak, meter.bytes)
                entry[0] += 1

            def __del__(self) -> None:
                if self.key in meter._excluded:
                    return
                entry = meter._live[self.key]
                entry[0] -= 1
                if entry[0] == 0:
                    meter.bytes -= entry[1]
                    del meter._live[self.key]

        with torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor):
            yield
