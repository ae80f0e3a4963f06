"""Profiling (layer 5): a model's segment costs and memory, the network, a simulator that runs the pipeline's own
schedules on profiled costs, and the auto-configuration that picks the fastest shape that fits."""

from lightning_varuna.profiling.autoconfig import rank_configs
from lightning_varuna.profiling.calibration import calibrate
from lightning_varuna.profiling.network import profile_network
from lightning_varuna.profiling.profile import ModelProfile
from lightning_varuna.profiling.profiler import profile_model
from lightning_varuna.profiling.simulator import Config, simulate

__all__ = ["Config", "ModelProfile", "calibrate", "profile_model", "profile_network", "rank_configs", "simulate"]
