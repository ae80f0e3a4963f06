"""The cores of a sweep's worker processes (one each, on the CPU), lent by a worker that has nothing to train to those
still training: near a study's end, when no trial is left to ask, the last trials' steps compute with more threads
instead of leaving cores idle while they run alone. A worker takes its core back as soon as it is about to train
again; the workers that borrowed it give it up at their next turn.

A step computed with more threads trains the same model within float rounding: a kernel may split a sum between threads
(a convolution's weight gradient in oneDNN differs in its last bits on 2 threads, and the optimizer's steps carry that
on). A trial whose process asks torch for deterministic algorithms (Lightning's ``Trainer(deterministic=True)``)
borrows no core: it computes on its own core and one thread throughout, bit for bit as alone on one thread.

Only threads started after the fork may compute with more threads: a forked process's main thread keeps its parent's
OpenMP team (libgomp is not fork-safe), and a parallel region of more than one thread there hangs once the parent
has run one. The sweep's turns run in threads of their own; the worker's main thread only pins itself."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from multiprocessing.context import BaseContext

import torch

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
        flags = list(self._idle)  # one reading: a flag that changes meanwhile must not count twice
        idle = [k for k, flag in enumerate(flags) if flag]
        training = [k for k, flag in enumerate(flags) if not flag]
        if worker not in training:
            return ()
        return tuple(self.cores[k] for n, k in enumerate(idle) if training[n % len(training)] == worker)

    def of(self, worker: int) -> LentCores:
        """Worker ``worker``'s side of the lending (in its process)."""
        return LentCores(self, worker)


class LentCores:
    """One worker's side of a `CoreLending`: say whether it is idle, and compute on its core and those lent to it."""

    def __init__(self, lending: CoreLending, worker: int) -> None:
        self.lending, self.worker = lending, worker
        self._pinned: tuple[int, ...] = ()  # the cores the process's threads are pinned to (none yet)

    def set_idle(self, idle: bool) -> None:
        self.lending.set_idle(self.worker, idle)

    def use(self, borrowing: bool = True) -> None:
        """Compute on this worker's core and those lent to it now (a turn starts): every thread of the process pinned
        to them, since the threads of torch's pools keep the cores they started with, and the calling thread's torch
        computing with a thread per core (checked each time: a thread may have taken another count from the process's
        default). With deterministic algorithms asked for, or not ``borrowing`` (the process's main thread, see
        module), its own core alone."""
        deterministic = torch.are_deterministic_algorithms_enabled()
        borrowed = self.lending.borrowed(self.worker) if borrowing and not deterministic else ()
        cores = (self.lending.cores[self.worker], *borrowed)
        if cores != self._pinned:
            for thread in os.listdir("/proc/self/task"):
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.sched_setaffinity(int(thread), cores)
            self._pinned = cores
        if torch.get_num_threads() != len(cores):
            torch.set_num_threads(len(cores))
