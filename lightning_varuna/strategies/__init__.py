"""Lightning strategies of lightning-varuna (importing this registers them with Lightning)."""

from lightning_varuna.strategies.varuna import VarunaStrategy

__all__ = ["VarunaStrategy"]
