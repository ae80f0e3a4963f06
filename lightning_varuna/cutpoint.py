"""`CutPoint`: the place in a model's forward where it may be cut into pipeline stages."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.pipelining import pipe_split

__all__ = ["CutPoint"]


class CutPoint(nn.Module):
    """Marks a point in ``forward`` where the model may be cut into pipeline stages.

    A ``CutPoint`` is the identity. Put one between the blocks of a model and call it once per forward
    with the tensor that flows from one block to the next (dim 0 is the batch)::

        for block, cut in zip(self.blocks, self.cuts):
            x = cut(block(x))

    `VarunaStrategy` picks the subset of cutpoints where the pipeline stages begin; the others stay
    inactive and cost nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self._is_stage_boundary = False
        self._observer: Callable[[CutPoint, object], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self._observer is not None:
            self._observer(self, x)
        if self._is_stage_boundary:
            pipe_split()  # a no-op when run eagerly; a split marker when traced by `torch.export`
        return x
