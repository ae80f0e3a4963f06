"""`CutPoint`: the place in a model's forward where it may be cut into pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from torch.distributed.pipelining import pipe_split

__all__ = ["CutPoint", "cut_after"]


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
        self._observer: Callable[[CutPoint, object], Tensor | None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self._observer is not None:
            replaced = self._observer(self, x)  # a profiling pass may pass on another tensor
            x = x if replaced is None else replaced
        if self._is_stage_boundary:
            pipe_split()  # a no-op when run eagerly; a split marker when traced by `torch.export`
        return x


def cut_after(modules: Iterable[nn.Module]) -> list[CutPoint]:
    """Put a `CutPoint` after each of ``modules``, without changing the model's code.

    For layers of a model you did not write (``nn.TransformerEncoder.layers``, a Hugging Face model's
    ``encoder.layer``): each module gets a child ``cutpoint`` and a forward hook that passes its output through it.
    A layer that returns a tuple (as Hugging Face layers may) has its first element passed through. The model keeps
    its structure, so code that inspects its layers (``nn.TransformerEncoder`` reads ``layers[0].self_attn``) works.
    An ``nn.Sequential`` (torchvision's ``resnet.layer1``) calls each of its children, so its CutPoint goes to its
    last layer instead, whose output is the Sequential's.

    Returns:
        The new CutPoints, in the order of ``modules``.
    """
    cuts: list[CutPoint] = []
    for module in modules:
        module = _last_layer(module)
        if hasattr(module, "cutpoint"):
            raise ValueError(f"`{type(module).__name__}` already has a `cutpoint`: call `cut_after` once per module.")
        module.cutpoint = _CutPointAfter()
        module.register_forward_hook(_through_cutpoint)
        cuts.append(module.cutpoint)
    return cuts


class _CutPointAfter(CutPoint):
    """The CutPoint `cut_after` gives a module, as its child: it marks the module's output, passed through it by
    the module's forward hook. A forward that runs the module's children itself (``for block in self.children()``,
    as timm's stages do) calls it too, with the last child's output: that call is the identity and marks
    nothing (``passed`` keeps what it passed, which must be the module's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.through_hook = False
        self.passed: object = None

    def forward(self, x: Tensor) -> Tensor:
        if self.through_hook:
            return super().forward(x)
        self.passed = x
        return x


def _last_layer(module: nn.Module) -> nn.Module:
    """The module whose output is ``module``'s: the last layer of a (nested) ``nn.Sequential``, else ``module``."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"`cut_after` got a `{type(module).__name__}`, which is never called itself: pass its layers "
            "(`cut_after(model.layers)` puts a CutPoint after each)."
        )
    while isinstance(module, nn.Sequential):
        if not len(module):
            raise ValueError("`cut_after` got an empty `nn.Sequential`: it has no output to cut after.")
        module = module[-1]
    return module


def _through_cutpoint(module: nn.Module, inputs: Any, output: Any) -> Any:
    cut = module.get_submodule("cutpoint")
    first = output[0] if isinstance(output, tuple) and output else output
    if isinstance(cut, _CutPointAfter):
        passed, cut.passed = cut.passed, None
        if passed is not None and passed is not first:
            raise ValueError(
                f"`cut_after` put a CutPoint in `{type(module).__name__}`, whose forward runs its children itself and "
                "combines their outputs, so the CutPoint changed its output. Cut after its last child instead, or "
                "after the modules that call it."
            )
        cut.through_hook = True
    try:
        return (cut(first), *output[1:]) if first is not output else cut(output)
    finally:
        if isinstance(cut, _CutPointAfter):
            cut.through_hook = False
