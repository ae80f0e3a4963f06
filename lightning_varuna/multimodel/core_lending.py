"""The cores of a sweep's worker processes (one each, on the CPU), lent by a worker that has nothing to train to those
still training: near a study's end, when no trial is left to ask, the last trials' steps compute with more threads
instead of leaving cores idle while they run alone. A worker takes its core back as soon as it trains again.

A step computed with more threads trains the same model within float tolerance (a kernel may split a sum between
threads); the tests compare such trials with each trained alone on one thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.context import BaseContext

__all__ = ["CoreLending", "LentCores"]


class CoreLending:
    """Which of ``cores`` (worker k's own is ``cores[k]``) each of the worker processes forked after this is made may
    compute on: its own, and those of the idle workers, shared out in turn among the workers that are training."""

    def __init__(self, cores: Sequence[int], context: BaseContext) -> None:
        self.cores = list(cores)
        self._idle = context.RawArray("b", len(self.cores))  # shared with the forked workers, read every step

    def set_idle(self, worker: int, idle: bool) -> None:
        """Say whether ``worker`` has nothing to train (its core is lent) or trains (it takes its core back)."""
        self._idle[worker] = idle

    def borrowed(self, worker: int) -> tuple[int, ...]:
        """The idle workers' cores that ``worker`` computes on now besides its own (none while it is idle itself)."""
        idle = [k for k, flag in enumerate(self._idle) if flag]
        training = [k for k, flag in enumerate(self._idle) if not flag]
        if worker not in training:
            return ()
        return tuple(self.cores[k] for n, k in enumerate(idle) if training[n % len(training)] == worker)

    def of(self, worker: int) -> LentCores:
        """Worker ``worker``'s side of the lending."""
        return LentCores(self, worker)


@dataclass(frozen=True)
class LentCores:
    """One worker's side of a `CoreLending`: the cores lent to it, and saying whether it is idle."""

    lending: CoreLending
    worker: int

    def borrowed(self) -> tuple[int, ...]:
        return self.lending.borrowed(self.worker)

    def set_idle(self, idle: bool) -> None:
        self.lending.set_idle(self.worker, idle)
