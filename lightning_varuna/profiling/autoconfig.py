"""Pick the fastest pipeline configuration that fits memory, by simulating every feasible one."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lightning_varuna.pipeline.schedules import SCHEDULES
from lightning_varuna.profiling.profile import ModelProfile
from lightning_varuna.profiling.simulator import Config, MissingMeasurement, Prediction, simulate

__all__ = ["candidate_configs", "choose_configs", "format_ranking", "rank_configs"]


def candidate_configs(
    profile: ModelProfile,
    devices: int,
    global_batch_size: int,
    *,
    nodes: int = 1,
    schedules: Sequence[str] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
) -> list[Config]:
    """Every (P, D, micro-batch size, schedule) with P x D = ``devices``, P up to the number of segments, D
    dividing the global batch and a micro-batch no larger than a replica's batch."""
    sizes = micro_batch_sizes or profile.micro_batch_sizes
    configs = []
    for stages in range(1, min(devices, len(profile.segments)) + 1):
        if devices % stages:
            continue
        replicas = devices // stages
        if global_batch_size % replicas:
            continue
        for mb in sizes:
            if mb > global_batch_size // replicas:
                continue
            for schedule in schedules or sorted(SCHEDULES):
                configs.append(Config(stages, replicas, mb, schedule, global_batch_size, nodes))
    return configs


def rank_configs(
    profile: ModelProfile,
    devices: int,
    global_batch_size: int,
    *,
    memory_bytes: int | None = None,
    nodes: int = 1,
    schedules: Sequence[str] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
) -> list[Prediction]:
    """Simulate every candidate and return those that fit ``memory_bytes`` per device, fastest first.

    Candidates that need a network measurement the profile lacks are left out with a warning.

    Raises:
        ValueError: no configuration is feasible (says why).
    """
    configs = candidate_configs(
        profile, devices, global_batch_size, nodes=nodes, schedules=schedules, micro_batch_sizes=micro_batch_sizes
    )
    if not configs:
        raise ValueError(
            f"No pipeline x data-parallel layout of {devices} devices splits a global batch of {global_batch_size} "
            f"over the profiled micro-batch sizes {profile.micro_batch_sizes} with at most {len(profile.segments)} "
            "stages; change the batch size or the device count, or profile more micro-batch sizes."
        )
    predictions, skipped = [], []
    for config in configs:
        try:
            predictions.append(simulate(profile, config))
        except MissingMeasurement as missing:
            skipped.append(f"{config}: {missing}")
    if skipped:
        message = f"Left out {len(skipped)} configuration(s) the profile cannot predict, e.g. {skipped[0]}"
        warnings.warn(message, stacklevel=2)
    if not predictions:
        raise ValueError(f"No configuration can be predicted from this profile: {skipped[0]}")
    fitting = [p for p in predictions if memory_bytes is None or max(p.memory_bytes) <= memory_bytes]
    if not fitting:
        assert memory_bytes is not None
        least = min(predictions, key=lambda p: max(p.memory_bytes))
        raise ValueError(
            f"No configuration fits {memory_bytes / 2**30:.2f} GiB per device; the smallest, {least.config}, needs "
            f"{max(least.memory_bytes) / 2**30:.2f} GiB. Use more devices or smaller micro-batches."
        )
    return sorted(fitting, key=lambda p: (p.step_s, max(p.memory_bytes)))


def choose_configs(
    profile: ModelProfile,
    world_size: int,
    global_batch_size: int,
    *,
    pipeline_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    micro_batch_size: int | None = None,
    schedule: str | None = None,
    memory_bytes: int | None = None,
    nodes: int = 1,
) -> list[Prediction]:
    """The configurations of ``world_size`` processes that keep every size given (``None``: free to choose) and fit
    ``memory_bytes``, fastest first: what ``VarunaStrategy`` runs when some of its sizes are ``"auto"``.

    Raises:
        ValueError: none is feasible (says why and what to change).
    """
    ranked = rank_configs(
        profile,
        world_size,
        global_batch_size,
        memory_bytes=memory_bytes,
        nodes=nodes,
        schedules=None if schedule is None else [schedule],
        micro_batch_sizes=None if micro_batch_size is None else [micro_batch_size],
    )
    ranked = [
        p
        for p in ranked
        if pipeline_parallel_size in (None, p.config.pipeline_parallel_size)
        and data_parallel_size in (None, p.config.data_parallel_size)
    ]
    if not ranked:
        raise ValueError(
            f"No configuration of {world_size} processes with the sizes you fixed fits; let more of "
            "`pipeline_parallel_size`, `data_parallel_size` and `micro_batch_size` be chosen, or change them."
        )
    return ranked


def format_ranking(predictions: Sequence[Prediction], limit: int | None = 20) -> str:
    """The ranked configurations as a table: predicted step time, memory and bubble."""
    lines = [
        f"{'rank':>4}  {'P':>2} {'D':>2} {'mb':>3} {'schedule':<8} {'step ms':>9} {'vs best':>8} "
        f"{'max memory MB':>14} {'bubble':>7}  cut at CutPoints"
    ]
    best = predictions[0].step_s if predictions else 1.0
    for i, p in enumerate(predictions[:limit], 1):
        c = p.config
        lines.append(
            f"{i:>4}  {c.pipeline_parallel_size:>2} {c.data_parallel_size:>2} {c.micro_batch_size:>3} "
            f"{c.schedule:<8} {p.step_s * 1e3:>9.1f} {p.step_s / best:>7.2f}x {max(p.memory_bytes) / 2**20:>14.1f} "
            f"{p.bubble:>7.0%}  {p.cut_at or '-'}"
        )
    return "\n".join(lines)
