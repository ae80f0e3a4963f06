"""A model built on the meta device (in ``configure_model``) given memory and initial values a segment at a time,
each segment parked in the spill store until its shard is spilled: the model is never whole in memory."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.utils import swap_tensors

from lightning_varuna.spilling.store import SpillStore

__all__ = ["MetaModel", "ParkedSegments"]


class MetaModel:
    """The modules of ``module`` that hold tensors on the meta device, materialized on ``device`` when asked.

    A module is materialized whole (all its own parameters and buffers) and initialized by its ``reset_parameters()``
    (every torch.nn layer has one); the tensors keep their identity (``torch.utils.swap_tensors``), so optimizers and
    traced segments that hold them see the values.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.device = device
        self._owners: dict[Tensor, list[tuple[str, nn.Module]]] = {}
        for name, owner in module.named_modules(remove_duplicate=False):
            for tensor in (*owner._parameters.values(), *owner._buffers.values()):
                if tensor is not None and tensor.is_meta:
                    self._owners.setdefault(tensor, []).append((name, owner))

    @staticmethod
    def needed(module: nn.Module) -> bool:
        """Whether ``module`` has parameters or buffers on the meta device."""
        return any(t.is_meta for t in (*module.parameters(), *module.buffers()))

    def materialize(self, tensors: Iterable[Tensor]) -> None:
        """Materialize the modules that hold any of ``tensors`` still on the meta device."""
        for tensor in tensors:
            for name, owner in self._owners.get(tensor, []):
                if any(t is not None and t.is_meta for t in (*owner._parameters.values(), *owner._buffers.values())):
                    self._materialize(name, owner)

    def materialize_rest(self) -> None:
        self.materialize(list(self._owners))

    def _materialize(self, name: str, owner: nn.Module) -> None:
        init = getattr(owner, "reset_parameters", None) or getattr(owner, "_reset_parameters", None)
        if init is None:
            raise TypeError(
                f"`{name or 'the model'}` ({type(owner).__name__}) was built on the meta device (in "
                "`configure_model`), and SpillingStrategy initializes such modules with their `reset_parameters()`, "
                "which it does not have. Define `reset_parameters()` on it (setting its parameters and buffers), or "
                "build the model in `__init__`."
            )
        for table, is_parameter in ((owner._parameters, True), (owner._buffers, False)):
            for tensor in table.values():
                if tensor is not None and tensor.is_meta:
                    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
                    swap_tensors(tensor, nn.Parameter(empty, tensor.requires_grad) if is_parameter else empty)
        with torch.no_grad():
            init()


class ParkedSegments:
    """The parameters of segments materialized before the shards are chosen, waiting in the spill store."""

    def __init__(self, store: SpillStore) -> None:
        self.store = store
        self._params: dict[int, list[nn.Parameter]] = {}

    def park(self, segment: int, params: list[nn.Parameter]) -> None:
        """Spill ``params`` (used by ``segment`` alone); they hold no elements until `unpark`."""
        self._params[segment] = params
        self.store.put(_key(segment), [p.data for p in params])
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if segment - 1 in self._params:
            self.store.wait_written(_key(segment - 1))  # one segment in flight: memory stays bounded

    def unpark(self, segments: Iterable[int]) -> None:
        """Give the parked parameters of ``segments`` their values back."""
        for s in segments:
            params = self._params.pop(s, [])
            if params:
                for p, value in zip(params, self.store.get(_key(s))):
                    p.data = value
                self.store.discard(_key(s))


def _key(segment: int) -> str:
    return f"segment{segment}.params"
