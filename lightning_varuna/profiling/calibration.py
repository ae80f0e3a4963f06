"""Learn what a real pipelined step costs beyond the profiled segments, from one measured step.

The profile times each segment alone. A training step also runs the user's ``training_step`` around every forward,
the runtime's bookkeeping, messages that wait on busy peers, and per-step work after the last backward. `calibrate`
fits those four costs (`RuntimeOverheads`) so that simulating the measured configuration reproduces its measured
timeline: the mean forward and backward durations, the pipeline's length and the whole step. They are stored in the
profile by processes per node, and the simulator adds them to every configuration run with that many processes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_varuna.profiling.profile import ModelProfile, RuntimeOverheads
from lightning_varuna.profiling.simulator import Config, Prediction, simulate
from lightning_varuna.profiling.trace import Span

__all__ = ["calibrate", "measured_step_s"]

_ROUNDS = 3  # the four costs depend on each other a little: fit them in turn, a few times


def calibrate(profile: ModelProfile, config: Config, measured: Sequence[Span]) -> ModelProfile:
    """A copy of ``profile`` whose overheads for ``config``'s processes per node make the simulation of ``config``
    match ``measured``, the timeline of its steps (a `PipelineTrace`): of several steps, the median one."""
    processes = config.processes_per_node
    forward, backward, pipeline, step = (statistics.median(x) for x in zip(*map(_measures, _by_step(measured))))

    def predict(overheads: RuntimeOverheads) -> Prediction:
        with_overheads = replace(profile, overheads={**profile.overheads, processes: overheads})
        return simulate(with_overheads, config, timeline=True)

    fitted = RuntimeOverheads()
    for _ in range(_ROUNDS):
        fitted.forward_s = _solve(lambda x: _mean_duration(predict(replace(fitted, forward_s=x)), "F") - forward)
        fitted.backward_s = _solve(lambda x: _mean_duration(predict(replace(fitted, backward_s=x)), "B") - backward)
        if config.pipeline_parallel_size > 1:
            fitted.message_s = _solve(lambda x: _pipeline_length(predict(replace(fitted, message_s=x))) - pipeline)
    fitted.step_s = max(0.0, step - predict(fitted).step_s)
    return replace(profile, overheads={**profile.overheads, processes: fitted})


def measured_step_s(measured: Sequence[Span]) -> float:
    """The median length of the steps in a measured timeline."""
    return statistics.median(_measures(spans)[3] for spans in _by_step(measured))


def _by_step(measured: Sequence[Span]) -> list[list[Span]]:
    steps: dict[int, list[Span]] = {}
    for span in measured:
        steps.setdefault(span.step, []).append(span)
    return list(steps.values())


def _measures(spans: list[Span]) -> tuple[float, float, float, float]:
    """One measured step: mean forward and backward, length of the pipelined part and of the whole step."""
    computed = [s for s in spans if s.name[0] in "FRB"]
    if not computed:
        raise ValueError("The measured timeline has no forward or backward; record it with PipelineTrace.")
    start = min(s.start_s for s in spans)
    return (
        statistics.mean(s.end_s - s.start_s for s in computed if s.name[0] == "F"),
        statistics.mean(s.end_s - s.start_s for s in computed if s.name[0] == "B"),
        max(s.end_s for s in computed) - start,
        max(s.end_s for s in spans) - start,
    )


def _pipeline_length(prediction: Prediction) -> float:
    return max(s.end_s for s in prediction.timeline if s.name[0] in "FRB")


def _mean_duration(prediction: Prediction, phase: str) -> float:
    return statistics.mean(s.end_s - s.start_s for s in prediction.timeline if s.name[0] == phase)


def _solve(excess: Callable[[float], float], high: float = 1.0, steps: int = 40) -> float:
    """The smallest non-negative x where the non-decreasing ``excess(x)`` reaches 0 (bisection; 0 if it already
    does at 0)."""
    if excess(0.0) >= 0:
        return 0.0
    low = 0.0
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (low, middle) if excess(middle) >= 0 else (middle, high)
    return high
