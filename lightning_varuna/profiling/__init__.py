"""Profile a model's segments and the network, simulate pipeline configurations, and pick the fastest."""

from lightning_varuna.profiling.autoconfig import rank_configs
from lightning_varuna.profiling.calibration import calibrate
from lightning_varuna.profiling.network import profile_network
from lightning_varuna.profiling.profile import ModelProfile
from lightning_varuna.profiling.profiler import profile_model
from lightning_varuna.profiling.simulator import Config, simulate

__all__ = ["Config", "ModelProfile", "calibrate", "profile_model", "profile_network", "rank_configs", "simulate"]
