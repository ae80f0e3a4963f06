"""A shard's autograd graph that outlives its parameters' memory: what autograd saves of the shard's parameters
(the parameter, ``weight.t()`` for a matmul) is saved as a reference to the parameter, and read from wherever its data
is when the backward runs. So a shard's forward can keep its activations for backward while its parameters are
spilled in between, and no saved view holds the memory of a spilled parameter (or of the read buffer it came in)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["parameters_saved_by_reference"]


@dataclass(frozen=True)
class _ParameterView:
    """A saved tensor that is a view of ``param``'s data, by its place in it (in elements)."""

    param: nn.Parameter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the start of the parameter's data
    param_stride: tuple[int, ...]  # the parameter's own, when saved

    def tensor(self) -> Tensor:
        data = self.param.data
        if data.stride() != self.param_stride:  # brought back in another layout: view a copy in the saved one
            data = torch.empty_strided(data.shape, self.param_stride, dtype=data.dtype, device=data.device).copy_(data)
        return data.as_strided(self.size, self.stride, data.storage_offset() + self.offset)


@contextmanager
def parameters_saved_by_reference(params: list[nn.Parameter]) -> Iterator[None]:
    """Inside the block, autograd saves views of ``params`` by reference (see the module): their data may be
    replaced (spilled and brought back, with the same values) before the backward runs."""
    by_storage: dict[int, list[nn.Parameter]] = {}
    for p in params:
        if p.numel() and p.layout == torch.strided:
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)

    def pack(saved: Tensor) -> Tensor | _ParameterView:
        view = _view_of(saved, by_storage)
        return view if view is not None else saved

    def unpack(saved: Tensor | _ParameterView) -> Tensor:
        return saved.tensor() if isinstance(saved, _ParameterView) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _view_of(saved: Tensor, by_storage: dict[int, list[nn.Parameter]]) -> _ParameterView | None:
    """``saved`` as a view of one of the parameters whose data shares its storage, if it is one (same dtype, within
    that parameter's elements)."""
    if saved.layout != torch.strided or saved.is_meta or type(saved) not in (Tensor, nn.Parameter):
        return None
    candidates = by_storage.get(saved.untyped_storage().data_ptr())
    if not candidates:
        return None
    for p in candidates:
        start = int(saved.storage_offset() - p.storage_offset())
        if p.dtype == saved.dtype and 0 <= start < p.numel():
            return _ParameterView(p, tuple(saved.shape), tuple(saved.stride()), start, tuple(p.stride()))
    return None
