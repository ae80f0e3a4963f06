"""How a sweep is stopped from outside: the signals `MultiModelTrainer.fit` and `optimize` handle while they run
(in the main thread; a handler only sets a flag or stops the scheduler, and each model stops at its next boundary)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_varuna.multimodel.scheduler import DeviceScheduler

__all__ = ["handled", "preempted_by_signals", "stopped_by_signals"]


@contextmanager
def preempted_by_signals(preempted: threading.Event, scheduler: DeviceScheduler) -> Iterator[None]:
    """SIGTERM, SIGUSR1 (a preemption notice, as SLURM sends) and Ctrl-C set ``preempted``: every trial checkpoints at
    its next step boundary and ends. A second Ctrl-C stops the sweep at once (each trial keeps its last checkpoint)."""

    def preempt(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and preempted.is_set():
            scheduler.stop("KeyboardInterrupt")
        preempted.set()

    with handled((signal.SIGINT, signal.SIGTERM, signal.SIGUSR1), preempt):
        yield


@contextmanager
def stopped_by_signals(scheduler: DeviceScheduler) -> Iterator[None]:
    """SIGTERM and Ctrl-C stop every model at its next shard boundary (each resumes from its last checkpoint)."""

    def stop(signum: int, frame: Any) -> None:
        scheduler.stop(signal.Signals(signum).name)

    with handled((signal.SIGINT, signal.SIGTERM), stop):
        yield


@contextmanager
def handled(signals: tuple[signal.Signals, ...], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Handle ``signals`` with ``handler`` in the block, then as before; nothing outside the main thread, where
    Python allows no handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
