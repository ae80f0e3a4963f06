"""Keep only one stage's parameters in memory while the whole model stays traceable."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ModelSkeleton"]

_CALL_INDEX = re.compile(r"@\d+(?=\.|$)")


@dataclass(frozen=True)
class _Slot:
    owner: str  # FQN of the module that holds the tensor
    name: str  # attribute name in that module
    fqn: str  # canonical FQN: the first name of a tensor shared by several modules (tied weights)
    is_parameter: bool


@dataclass(frozen=True)
class _Spec:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


class ModelSkeleton:
    """The names, shapes and ties of every parameter and buffer of a model.

    A rank that frees the parameters of the other stages can still trace the whole model: the skeleton
    puts a stand-in into every slot while ``torch.export`` runs (zero-stride for parameters: one element of
    memory), then puts the real tensors back.
    """

    def __init__(self, module: nn.Module, device: torch.device | None = None) -> None:
        """``device``: where every stand-in goes (the inputs' device, for a model whose tensors wait elsewhere or on
        the meta device between uses); None: where each tensor is."""
        self._slots: list[_Slot] = []
        self._specs: dict[str, _Spec] = {}
        first_name: dict[int, str] = {}
        for owner_name, owner in module.named_modules(remove_duplicate=False):
            for table, is_parameter in ((owner._parameters, True), (owner._buffers, False)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    fqn = f"{owner_name}.{name}" if owner_name else name
                    canonical = first_name.setdefault(id(tensor), fqn)
                    self._slots.append(_Slot(owner_name, name, canonical, is_parameter))
                    self._specs[canonical] = _Spec(
                        tensor.shape, tensor.dtype, device or tensor.device, is_parameter and tensor.requires_grad
                    )
        self._aliases = {f"{s.owner}.{s.name}" if s.owner else s.name: s.fqn for s in self._slots}

    def canonical(self, fqn: str) -> str:
        """The canonical FQN of a (possibly tied) parameter or buffer name.

        A traced module called more than once in a forward (an embedding applied to two inputs) appears once per
        call, as ``embedding@1`` for the second: those names are the module's own.
        """
        fqn = _CALL_INDEX.sub("", fqn)
        return self._aliases.get(fqn, fqn)

    @property
    def parameter_names(self) -> list[str]:
        return list(dict.fromkeys(s.fqn for s in self._slots if s.is_parameter))

    @property
    def tensor_names(self) -> set[str]:
        """The canonical FQNs of every parameter and buffer."""
        return set(self._specs)

    def release(self, module: nn.Module, keep: set[str]) -> dict[str, list[str]]:
        """Drop every parameter and buffer whose canonical FQN is not in ``keep`` (frees their memory); the names
        dropped, by the FQN of the module that held them."""
        released: dict[str, list[str]] = {}
        for slot in self._slots:
            if slot.fqn not in keep:
                self._table(module, slot)[slot.name] = None
                released.setdefault(slot.owner, []).append(slot.name)
        return released

    @contextmanager
    def stand_ins(
        self, module: nn.Module, missing_only: bool = False, device: torch.device | None = None
    ) -> Iterator[None]:
        """Fill every slot (``missing_only``: every empty slot, such as other stages') with a memory-free stand-in of
        the right shape (on ``device``; None: the tensor's); restore the real tensors after."""
        saved = [(slot, self._table(module, slot).get(slot.name)) for slot in self._slots]
        made: dict[str, Tensor] = {}
        for slot, tensor in saved:
            if missing_only and tensor is not None:
                continue
            if slot.fqn not in made:
                spec = self._specs[slot.fqn]
                where = device or spec.device
                if slot.is_parameter:
                    stand_in = torch.empty((), dtype=spec.dtype, device=where).expand(spec.shape)
                    made[slot.fqn] = nn.Parameter(stand_in, requires_grad=spec.requires_grad)
                else:
                    # A forward may update a buffer in place (BatchNorm's running statistics), which a zero-stride
                    # tensor cannot take. Uninitialised memory is never written while tracing (export runs on fake
                    # tensors) and large allocations are only committed when written.
                    made[slot.fqn] = torch.empty(spec.shape, dtype=spec.dtype, device=where)
            self._table(module, slot)[slot.name] = made[slot.fqn]
        try:
            yield
        finally:
            for slot, tensor in saved:
                if not (missing_only and tensor is not None):  # a real tensor, moved meanwhile, stays as it is now
                    self._table(module, slot)[slot.name] = tensor

    @staticmethod
    def _table(module: nn.Module, slot: _Slot) -> dict:
        owner = module.get_submodule(slot.owner)
        return owner._parameters if slot.is_parameter else owner._buffers
