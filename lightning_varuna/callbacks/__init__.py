"""Lightning callbacks of lightning-varuna."""

from lightning_varuna.callbacks.morph import MorphCallback

__all__ = ["MorphCallback"]
