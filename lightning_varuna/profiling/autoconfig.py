"""Pick the fastest configuration that fits memory, by simulating every feasible one: pipeline x data-parallel
shapes of the devices and, given a memory budget per device, training spilled on one of them."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from lightning_varuna.data.microbatch import microbatch_sizes
from lightning_varuna.pipeline.schedules import INTERLEAVED, SCHEDULES, V_SHAPED, splits_into_rounds
from lightning_varuna.profiling.profile import ModelProfile
from lightning_varuna.profiling.simulator import Config, MissingMeasurement, Prediction, simulate
from lightning_varuna.profiling.spilled import TIERS, SpilledConfig, SpilledPrediction, simulate_spilled

__all__ = ["candidate_configs", "choose_configs", "describe_choice", "format_ranking", "rank_configs"]

Ranked = Prediction | SpilledPrediction


def candidate_configs(
    profile: ModelProfile,
    devices: int,
    global_batch_size: int,
    *,
    nodes: int = 1,
    schedules: Sequence[str] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    stages_per_rank: int | None = None,
) -> list[Config]:
    """Every (P, D, micro-batch size, schedule) with P x D = ``devices``, P up to the number of segments, D
    dividing the global batch and a micro-batch no larger than a replica's batch.

    An interleaved schedule (`INTERLEAVED`) is a candidate at every V = ``stages_per_rank`` (None: each from 2) with
    P >= 2 and P x V stages of the profile's segments (one CutPoint between two), where the replica's micro-batches
    split into its rounds (`splits_into_rounds`); a V-shaped one (`V_SHAPED`) at V = 2 only."""
    sizes = micro_batch_sizes or profile.micro_batch_sizes
    segments = len(profile.segments)
    configs = []
    for stages in range(1, min(devices, segments) + 1):
        if devices % stages:
            continue
        replicas = devices // stages
        if global_batch_size % replicas:
            continue
        for mb in sizes:
            if mb > global_batch_size // replicas:
                continue
            for schedule in schedules or sorted([*SCHEDULES, *INTERLEAVED]):
                shape = (stages, replicas, mb, schedule, global_batch_size, nodes)
                if schedule not in INTERLEAVED:
                    configs.append(Config(*shape))
                    continue
                microbatches = len(microbatch_sizes(global_batch_size // replicas, mb))
                rounds = schedule in V_SHAPED or splits_into_rounds(stages, microbatches)
                if stages < 2 or not rounds or (schedule in V_SHAPED and stages_per_rank not in (None, 2)):
                    continue
                per_rank = range(2, segments // stages + 1) if stages_per_rank is None else [stages_per_rank]
                per_rank = [2] if schedule in V_SHAPED else per_rank
                configs += [Config(*shape, stages_per_rank=v) for v in per_rank if stages * v <= segments]
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
    spilled: bool = True,
    tiers: Sequence[str] = TIERS,
    stages_per_rank: int | None = None,
) -> list[Ranked]:
    """Simulate every candidate and return those that fit ``memory_bytes`` per device, fastest first.

    With a budget (and ``spilled``), training spilled on one device (`SpillingStrategy`, its shards packed for the
    budget, on each of ``tiers`` the profile measured) is ranked with the pipeline shapes; a model whose shards would
    be one (it fits the budget whole) is not spilled, so that candidate is left out. ``stages_per_rank`` binds V of the
    interleaved candidates (None: every V the segments allow). Candidates that need a measurement
    the profile lacks are left out with a warning; those that do not fit the budget are left out (not ranked).

    Raises:
        ValueError: no configuration is feasible (says why).
    """
    configs = candidate_configs(
        profile,
        devices,
        global_batch_size,
        nodes=nodes,
        schedules=schedules,
        micro_batch_sizes=micro_batch_sizes,
        stages_per_rank=stages_per_rank,
    )
    predictions: list[Ranked] = []
    skipped: list[str] = []
    spilling_refused = None
    if spilled and memory_bytes is not None:
        for tier in tiers:
            if tier not in profile.spill:
                spilling_refused = (
                    f"the profile has no spill times of the {tier} tier: profile the model again "
                    "(`lightning-varuna profile` measures them)"
                )
                skipped.append(f"spilled to {tier}: {spilling_refused}")
                continue
            try:
                spilled_prediction = simulate_spilled(profile, SpilledConfig(global_batch_size, memory_bytes, tier))
            except ValueError as refused:  # the budget cannot train it spilled
                spilling_refused = str(refused)
                continue
            if len(spilled_prediction.shards) > 1:
                predictions.append(spilled_prediction)
    if not configs and not predictions:
        interleaved = (
            " (an interleaved schedule needs 2 or more pipeline ranks of V >= 2 stages each, at most one stage a "
            "segment, and a number of micro-batches that splits into its rounds)"
            if schedules and set(schedules) <= set(INTERLEAVED)
            else ""
        )
        raise ValueError(
            f"No pipeline x data-parallel layout of {devices} devices splits a global batch of {global_batch_size} "
            f"over the profiled micro-batch sizes {profile.micro_batch_sizes} with at most {len(profile.segments)} "
            f"stages{interleaved}; change the batch size or the device count, or profile more micro-batch sizes."
        )
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
        spilling = f" Spilled on one device: {spilling_refused}" if spilling_refused else ""
        raise ValueError(
            f"No configuration fits {memory_bytes / 2**30:.2f} GiB per device; the smallest, {least.config}, needs "
            f"{max(least.memory_bytes) / 2**30:.2f} GiB. Use more devices or smaller micro-batches.{spilling}"
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
    stages_per_rank: int | None = None,
    memory_bytes: int | None = None,
    nodes: int = 1,
    spill_tiers: Sequence[str] = (),
) -> list[Ranked]:
    """The configurations of ``world_size`` processes that keep every size given (``None``: free to choose) and fit
    ``memory_bytes``, fastest first: what ``VarunaStrategy`` runs when some of its sizes are ``"auto"``.

    Training spilled on one device, to one of ``spill_tiers``, is ranked with them when there is one process, a
    budget and no pipeline or data-parallel size above 1 was asked for (``micro_batch_size`` and ``schedule`` only
    bind the pipelined candidates). With more processes it is not: it would leave all but one of them idle.

    Raises:
        ValueError: none is feasible (says why and what to change).
    """
    spilled = world_size == 1 and memory_bytes is not None and pipeline_parallel_size in (None, 1)
    spilled = spilled and data_parallel_size in (None, 1) and bool(spill_tiers)
    try:
        everything = rank_configs(
            profile,
            world_size,
            global_batch_size,
            memory_bytes=memory_bytes,
            nodes=nodes,
            schedules=None if schedule is None else [schedule],
            micro_batch_sizes=None if micro_batch_size is None else [micro_batch_size],
            spilled=spilled,
            tiers=spill_tiers,
            stages_per_rank=stages_per_rank,
        )
    except ValueError as refused:
        if world_size == 1 or memory_bytes is None or not spill_tiers:
            raise
        raise ValueError(
            f"{refused} Training spilled is chosen on one process only: start the job on one process to train "
            "it spilled within this budget."
        ) from None
    ranked = [
        p
        for p in everything
        if isinstance(p, SpilledPrediction)
        or (
            pipeline_parallel_size in (None, p.config.pipeline_parallel_size)
            and data_parallel_size in (None, p.config.data_parallel_size)
        )
    ]
    if not ranked:
        raise ValueError(
            f"No configuration of {world_size} processes with the sizes you fixed fits; let more of "
            "`pipeline_parallel_size`, `data_parallel_size` and `micro_batch_size` be chosen, or change them."
        )
    return ranked


def format_ranking(predictions: Sequence[Ranked], limit: int | None = 20) -> str:
    """The ranked configurations as a table: predicted step time, memory per device, and what the time is made of
    (a pipeline's bubble and cut; a spilled step's shards, recomputes, transfers and waits)."""
    header = f"{'rank':>4}  {'configuration':<42} {'step ms':>9} {'vs best':>8} {'MiB per device':>14}"
    lines = [f"{header}  details (pipeline: bubble, cut; spilled: shards)"]
    best = predictions[0].step_s if predictions else 1.0
    for i, p in enumerate(predictions[:limit], 1):
        lines.append(
            f"{i:>4}  {str(p.config):<42} {p.step_s * 1e3:>9.1f} {p.step_s / best:>7.2f}x "
            f"{max(p.memory_bytes) / 2**20:>14.1f}  {_details(p)}"
        )
    return "\n".join(lines)


def describe_choice(ranked: Sequence[Ranked]) -> str:
    """The configuration chosen and the runner-up, with their predicted step times and memory per device."""
    best = ranked[0]
    text = f"chose {best.config}: predicted {_predicted(best)}"
    if len(ranked) > 1:
        second = ranked[1]
        text += f"; runner-up {second.config}: predicted {_predicted(second)} ({second.step_s / best.step_s - 1:+.1%})"
    return text + "."


def _predicted(p: Ranked) -> str:
    return f"{p.step_s * 1e3:.1f} ms a step, {max(p.memory_bytes) / 2**20:.1f} MiB per device"


def _details(p: Ranked) -> str:
    if isinstance(p, SpilledPrediction):
        return (
            f"{len(p.shards)} shards, {len(p.recomputed)} recompute, {p.bytes_read / 2**20:.1f} MiB read + "
            f"{p.bytes_written / 2**20:.1f} written, waits {p.wait_s * 1e3:.1f} ms"
        )
    return f"bubble {p.bubble:.0%}, cut at {p.cut_at or '-'}"
