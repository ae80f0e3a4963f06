"""Lightning strategies (layer 8): `VarunaStrategy` and `SpillingStrategy`, adapters from Lightning's hooks to the
layers below, and what they share (importing this registers them with Lightning)."""

from lightning_varuna.strategies.spilling import SpillingStrategy
from lightning_varuna.strategies.varuna import VarunaStrategy

__all__ = ["SpillingStrategy", "VarunaStrategy"]
