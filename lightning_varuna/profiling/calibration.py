"""Learn what a real pipelined step costs beyond the profiled segments, from measured steps.

The profile times each segment alone. A training step also runs the user's ``training_step`` around every forward,
the runtime's bookkeeping, messages that wait on busy peers, and per-step work after the last backward. For each
measured configuration, `calibrate` fits those costs (`RuntimeOverheads`) so that simulating it reproduces its
measured timeline: the mean forward and backward durations, the pipeline's length, the optimizer step, the
reduction of the gradients (and tied weights) on the rank that reaches it last, and the whole step. Measured
configurations with as many processes per node are combined, whatever their schedule: the cost per forward and per
backward is kept per micro-batch size (linear between two sizes; beyond them, from the nearest along the slope of a
line fitted to all). Configurations with replicas then teach how long the all-reduce waits for the slowest replica,
in proportion to the pipeline's length, and configurations whose schedule splits the backward (zero-bubble) how much
longer than profiled a weight pass takes, deferred behind other work (a first stage's weight pass is its whole
backward: its input takes no gradient). The simulator adds the costs to every
configuration run with that many processes per node.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_varuna.pipeline.schedules import Action, Phase
from lightning_varuna.profiling.profile import ModelProfile, RuntimeOverheads
from lightning_varuna.profiling.simulator import Config, Prediction, simulate
from lightning_varuna.profiling.spilled import SpilledConfig, simulate_spilled
from lightning_varuna.profiling.trace import Span

__all__ = ["calibrate", "calibrate_spilled", "measured_step_s"]

_ROUNDS = 3  # the costs of one configuration depend on each other a little: fit them in turn, a few times
_MAX_WEIGHT_FACTOR = 16.0


def calibrate(profile: ModelProfile, measured: Sequence[tuple[Config, Sequence[Span]]]) -> ModelProfile:
    """A copy of ``profile`` whose overheads make the simulation of each measured configuration match its timeline
    (a `PipelineTrace`; of several steps, the median one). Overheads of other process counts are kept, and of a
    process count measured again, what its new runs do not teach: the replicas' wait without a run with replicas, the
    weight passes' factor without a run that splits the backward of a stage after the first, the optimizer step's
    factor and the reduction's cost without a run that traced them. The costs per micro-batch size are those of the
    new runs alone."""
    by_processes: dict[int, list[tuple[Config, Sequence[Span]]]] = {}
    for config, spans in measured:
        by_processes.setdefault(config.processes_per_node, []).append((config, spans))
    combined = {}
    for processes, runs in by_processes.items():
        # Replicas wait for each other at the all-reduce; the costs of a step are learned from runs without them.
        alone = [(c, spans) for c, spans in runs if c.data_parallel_size == 1] or runs
        overheads = _combine([(c.micro_batch_size, _fit(profile, c, spans)) for c, spans in alone])
        replicated = [(c, spans) for c, spans in runs if c.data_parallel_size > 1]
        split = [(c, spans) for c, spans in runs if _weight_durations(spans)]
        with_overheads = _with_overheads(profile, processes, overheads)  # sees what is set on ``overheads`` below
        before = profile.overheads.get(processes, RuntimeOverheads())  # what the new runs do not teach is kept
        if split:  # with the costs that all the runs teach
            overheads.weight_factor = statistics.mean(_weight_factor(with_overheads, c, spans) for c, spans in split)
        else:
            overheads.weight_factor = before.weight_factor
        if overheads.optimizer_factor is None:
            overheads.optimizer_factor = before.optimizer_factor
        if overheads.reduce_s is None:
            overheads.reduce_s = before.reduce_s
        if replicated:
            overheads.replica_lag = statistics.mean(_replica_lag(with_overheads, c, spans) for c, spans in replicated)
        else:
            overheads.replica_lag = before.replica_lag
        combined[processes] = overheads
    return replace(profile, overheads={**profile.overheads, **combined})


def calibrate_spilled(profile: ModelProfile, measured: Sequence[tuple[SpilledConfig, float]]) -> ModelProfile:
    """A copy of ``profile`` whose spill tiers' ``compute_factor`` makes the simulated step of each measured spilled
    configuration (config, measured seconds a step) as long as measured; of several on a tier, the mean factor."""
    spill = dict(profile.spill)
    for tier in sorted({config.tier for config, _ in measured}):
        factors = [_compute_factor(profile, config, step_s) for config, step_s in measured if config.tier == tier]
        spill[tier] = replace(spill[tier], compute_factor=statistics.mean(factors))
    return replace(profile, spill=spill)


def _compute_factor(profile: ModelProfile, config: SpilledConfig, step_s: float, steps: int = 40) -> float:
    """The compute factor (0.1 to 16, bisected) with which the simulated step of ``config`` takes ``step_s``."""
    low, high = 0.1, 16.0
    for _ in range(steps):
        middle = (low + high) / 2
        costs = replace(profile.spill[config.tier], compute_factor=middle)
        predicted = simulate_spilled(replace(profile, spill={**profile.spill, config.tier: costs}), config).step_s
        low, high = (low, middle) if predicted >= step_s else (middle, high)
    return high


def measured_step_s(measured: Sequence[Span]) -> float:
    """The median length of the steps in a measured timeline."""
    return statistics.median(_measures(spans)[3] for spans in _by_step(measured))


def _fit(profile: ModelProfile, config: Config, measured: Sequence[Span]) -> RuntimeOverheads:
    """Constant costs that make the simulation of ``config`` match its median measured step."""
    forward, backward, pipeline, step = (statistics.median(x) for x in zip(*map(_measures, _by_step(measured))))

    def predict(overheads: RuntimeOverheads) -> Prediction:
        return simulate(_with_overheads(profile, config.processes_per_node, overheads), config, timeline=True)

    splits_weights = bool(_weight_durations(measured))
    # The profile may over-estimate an action at some sizes (measured on the CPU: GPT's forwards at 8 rows about 8%
    # faster in a pipeline than profiled): a cost per action may be negative, down to minus the shortest action as
    # simulated without costs (the simulator never lets an action take less than no time).
    profiled = predict(RuntimeOverheads()).timeline
    least_forward = min(s.end_s - s.start_s for s in profiled if s.phase is Phase.FORWARD)
    least_backward = min(_computed_backwards(profiled), default=0.0)

    fitted = RuntimeOverheads()
    for _ in range(_ROUNDS):
        fitted.forward_s = _solve(
            lambda x: _mean_duration(predict(replace(fitted, forward_s=x)), Phase.FORWARD) - forward,
            low=-least_forward,
        )
        fitted.backward_s = _solve(
            lambda x: statistics.mean(_computed_backwards(predict(replace(fitted, backward_s=x)).timeline)) - backward,
            low=-least_backward,
        )
        if splits_weights:
            fitted.weight_factor = _weight_factor(
                _with_overheads(profile, config.processes_per_node, fitted), config, measured
            )
        if config.pipeline_parallel_size > 1:
            fitted.message_s = _solve(lambda x: _pipeline_length(predict(replace(fitted, message_s=x))) - pipeline)
    as_profiled = predict(fitted)  # the optimizer step and the reduction without their costs
    fitted.optimizer_factor = _optimizer_factor(as_profiled, measured)
    fitted.reduce_s = _reduce_cost(as_profiled, measured)
    fitted.step_s = _solve(lambda x: predict(replace(fitted, step_s=x)).step_s - step, high=step)
    return fitted


def _reduce_cost(prediction: Prediction, measured: Sequence[Span]) -> float | None:
    """How much longer than simulated the step's reduction takes on the rank that reduces and starts it last (it
    waits for no other; the median over the steps); None if the simulated step reduces nothing."""
    reducing = {s.stage for s in prediction.timeline if s.work == "all-reduce"}
    last = _started_last(measured, "all-reduce", reducing)
    if not reducing or not last:
        return None
    return statistics.median(last) - prediction.allreduce_s


def _optimizer_factor(prediction: Prediction, measured: Sequence[Span]) -> float | None:
    """How many times its simulated time the optimizer step takes on the rank that starts it last (the median over
    the steps); None if the measured timeline has none."""
    last = _started_last(measured, "optimizer", {s.stage for s in prediction.timeline})
    if not last or prediction.optimizer_s <= 0:
        return None
    return statistics.median(last) / prediction.optimizer_s


def _started_last(measured: Sequence[Span], work: str, ranks: set[int]) -> list[float]:
    """Per measured step, the duration of the ``work`` span that started last on ``ranks``."""
    durations = []
    for spans in _by_step(measured):
        candidates = [s for s in spans if s.work == work and s.stage in ranks]
        if candidates:
            last = max(candidates, key=lambda s: s.start_s)
            durations.append(last.end_s - last.start_s)
    return durations


def _replica_lag(profile: ModelProfile, config: Config, measured: Sequence[Span]) -> float:
    """The wait for the slowest replica that makes the simulated step of ``config`` as long as the measured one, as
    a share of the pipeline's length."""
    prediction = simulate(profile, config)
    return max(0.0, (measured_step_s(measured) - prediction.step_s) / prediction.pipeline_s)


def _weight_factor(profile: ModelProfile, config: Config, measured: Sequence[Span]) -> float:
    """How many times their profiled time the weight passes of ``config`` take, so that the simulated ones last as
    long as the measured ones (their mean, the median over the steps)."""
    weight = statistics.median(statistics.mean(_weight_durations(spans)) for spans in _by_step(measured))
    processes = config.processes_per_node

    def predict(factor: float) -> Prediction:
        costs = replace(profile.overheads[processes], weight_factor=factor)
        return simulate(_with_overheads(profile, processes, costs), config, timeline=True)

    return _solve(lambda x: statistics.mean(_weight_durations(predict(x).timeline)) - weight, high=_MAX_WEIGHT_FACTOR)


def _combine(fits: list[tuple[int, RuntimeOverheads]]) -> RuntimeOverheads:
    """One set of costs from the fits of several micro-batch sizes: per forward and per backward the cost at each
    size (the mean of its fits) and a line in the rows (constant with one size), per message and per step the
    mean."""
    rows = [mb for mb, _ in fits]
    forward_s, forward_per_row_s = _line(rows, [o.forward_s for _, o in fits])
    backward_s, backward_per_row_s = _line(rows, [o.backward_s for _, o in fits])
    by_rows = [
        (size, statistics.mean(o.forward_s for mb, o in fits if mb == size),
         statistics.mean(o.backward_s for mb, o in fits if mb == size))
        for size in sorted(set(rows))
    ]  # fmt: skip
    return RuntimeOverheads(
        forward_s=forward_s,
        backward_s=backward_s,
        message_s=statistics.mean(o.message_s for _, o in fits),
        step_s=statistics.mean(o.step_s for _, o in fits),
        optimizer_factor=_mean_learned([o.optimizer_factor for _, o in fits]),
        reduce_s=_mean_learned([o.reduce_s for _, o in fits]),
        forward_per_row_s=forward_per_row_s,
        backward_per_row_s=backward_per_row_s,
        by_rows=by_rows,
    )


def _mean_learned(values: list[float | None]) -> float | None:
    """The mean of the values learned (not None); None if none was."""
    learned = [value for value in values if value is not None]
    return statistics.mean(learned) if learned else None


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope: the slope non-negative (else a flat line through the mean, as with one x),
    and where no y is negative, the intercept too (else through the origin)."""
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    if slope <= 0:
        return mean_y, 0.0
    if mean_y - slope * mean_x < 0 and min(ys) >= 0:  # through the origin instead
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return mean_y - slope * mean_x, slope


def _by_step(measured: Sequence[Span]) -> list[list[Span]]:
    steps: dict[int, list[Span]] = {}
    for span in measured:
        steps.setdefault(span.step, []).append(span)
    return list(steps.values())


def _measures(spans: list[Span]) -> tuple[float, float, float, float]:
    """One measured step: mean forward and backward, length of the pipelined part and of the whole step."""
    computed = [s for s in spans if s.phase is not None]
    if not computed:
        raise ValueError("The measured timeline has no forward or backward; record it with PipelineTrace.")
    start = min(s.start_s for s in spans)
    return (
        statistics.mean(s.end_s - s.start_s for s in computed if s.phase is Phase.FORWARD),
        statistics.mean(_computed_backwards(spans) or [0.0]),
        max(s.end_s for s in computed) - start,
        max(s.end_s for s in spans) - start,
    )


def _computed_backwards(spans: Sequence[Span]) -> list[float]:
    """The durations of the backwards that compute something. Of a split backward, a first stage's weight pass is its
    whole backward (its input takes no gradient: the runtime's input part there does nothing, the simulator's takes
    no time)."""
    split = _splits_backward(spans)
    return [
        s.end_s - s.start_s
        for s in spans
        if (s.phase is Phase.BACKWARD and not (split and _on_first_stage(s)))
        or (s.phase is Phase.WEIGHT and _on_first_stage(s))
    ]


def _weight_durations(spans: Sequence[Span]) -> list[float]:
    """The durations of the weight passes split from a backward (not a first stage's: its whole backward)."""
    return [s.end_s - s.start_s for s in spans if s.phase is Phase.WEIGHT and not _on_first_stage(s)]


def _on_first_stage(span: Span) -> bool:
    return isinstance(span.work, Action) and span.work.stage_on(span.stage) == 0


def _splits_backward(spans: Sequence[Span]) -> bool:
    return any(s.phase is Phase.WEIGHT for s in spans)


def _with_overheads(profile: ModelProfile, processes: int, overheads: RuntimeOverheads) -> ModelProfile:
    """``profile`` with ``overheads`` for ``processes`` processes per node (the same object: later changes show)."""
    return replace(profile, overheads={**profile.overheads, processes: overheads})


def _pipeline_length(prediction: Prediction) -> float:
    return max(s.end_s for s in prediction.timeline if s.phase is not None)


def _mean_duration(prediction: Prediction, phase: Phase) -> float:
    return statistics.mean(s.end_s - s.start_s for s in prediction.timeline if s.phase is phase)


def _solve(excess: Callable[[float], float], low: float = 0.0, high: float = 1.0, steps: int = 40) -> float:
    """The smallest x from ``low`` where the non-decreasing ``excess(x)`` reaches 0 (bisection; ``low`` if it already
    does there)."""
    if excess(low) >= 0:
        return low
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (low, middle) if excess(middle) >= 0 else (middle, high)
    return high
