"""Blocking communication that leaves the calling thread responsive: to signals, and to a peer's failure.

gloo's `Work.wait()` and its collectives block in C++, where Python runs no signal handlers (a SIGTERM is not acted
on until they return, which may be never); `Work.is_completed()` stays False until `wait()` returned; and a
`wait(timeout=...)` that expires closes the connection to the peer for good. So a helper thread makes the blocking
call while the caller wakes every half second to run the signal handlers and ``on_wait``, which raises to give up.
NCCL's waits do not block the CPU (they order the calling thread's CUDA stream), and its calls belong on the thread
that runs the stage: they are made directly.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["Waiter"]

T = TypeVar("T")

# How often a rank that waits for a peer runs `on_wait` (and Python's signal handlers).
_POLL_S = 0.5


class Waiter:
    """Makes blocking calls on a helper thread (see above) for a process group of ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._in_thread = backend != dist.Backend.NCCL
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list]] | None = None

    @property
    def polls(self) -> bool:
        """Whether a wait runs ``on_wait`` twice a second (not over NCCL)."""
        return self._in_thread

    def call(self, blocking: Callable[[], T], on_wait: Callable[[], None] | None = None) -> T:
        """Return ``blocking()``; while it blocks, run ``on_wait`` every half second.

        If ``on_wait`` (or a signal handler) raises, the call is given up: its helper thread stays blocked in it, and
        the next call gets a new helper.
        """
        if not self._in_thread:
            return blocking()
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._calls,), name="lightning-varuna-waiter", daemon=True).start()
        done = threading.Event()
        outcome: list = []  # [result] or [None, error]
        self._calls.put((blocking, done, outcome))
        try:
            while not done.wait(_POLL_S):
                if on_wait is not None:
                    on_wait()
        except BaseException:
            self._calls = None
            raise
        if len(outcome) > 1:
            raise outcome[1]
        return outcome[0]


def _serve(calls: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list]]) -> None:
    while True:
        blocking, done, outcome = calls.get()
        try:
            outcome.append(blocking())
        except BaseException as error:  # raised in the calling thread
            outcome += [None, error]
        done.set()
