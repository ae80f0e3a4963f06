"""What ``torch.export`` needs to trace the models users bring, applied only while a model is traced."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lightning_varuna._torch_private import transformer_module

__all__ = ["traceable_torch_modules"]


def _is_causal_as_given(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
    return is_causal is True


@contextmanager
def traceable_torch_modules() -> Iterator[None]:
    """Make ``nn.Transformer``, ``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` traceable.

    Given a mask and no ``is_causal``, they compare the mask's values with a causal mask to decide whether attention
    may take its causal shortcut: a guard on data that ``torch.export`` cannot trace. While tracing, the mask is
    simply applied as given (``is_causal`` stays what the caller said): the same attention, computed from the mask.
    """
    detect = transformer_module._detect_is_causal_mask
    transformer_module._detect_is_causal_mask = _is_causal_as_given
    try:
        yield
    finally:
        transformer_module._detect_is_causal_mask = detect
