"""Lightning strategies of lightning-varuna (importing this registers them with Lightning)."""

from lightning_varuna.strategies.spilling import SpillingStrategy
from lightning_varuna.strategies.varuna import VarunaStrategy

__all__ = ["SpillingStrategy", "VarunaStrategy"]
