"""The log lines and Python warnings of a sweep's worker processes, printed by the sweep's process: there a display
prints them above its bars, where a worker would print into them (and draw again the bars it inherited, as they were
when it was forked)."""

from __future__ import annotations

import logging
import queue
import warnings
from logging.handlers import QueueHandler
from multiprocessing.context import BaseContext

from lightning_varuna.multimodel.report import warning_shown_by

__all__ = ["WorkerLogs"]

_LOGGERS = ("lightning.pytorch", "lightning.fabric", None)  # Lightning's do not propagate to the root logger


class WorkerLogs:
    """A queue from the worker processes to the sweep's process, made before they are forked."""

    def __init__(self, context: BaseContext) -> None:
        self._queue = context.Queue()

    def send_from_here(self) -> None:
        """In a worker: what it logs (Lightning's loggers and those that reach the root logger) and warns is sent
        to the sweep's process instead of printed, as the worker's loggers and warning filters let it through."""
        warnings.showwarning = warning_shown_by(lambda text: logging.getLogger("py.warnings").warning(text.rstrip()))
        handler = QueueHandler(self._queue)
        for name in _LOGGERS:
            logging.getLogger(name).handlers = [handler]

    def print_sent(self) -> None:
        """In the sweep's process: log what the workers have sent so far through its own loggers' handlers."""
        while True:
            try:
                record = self._queue.get_nowait()
            except queue.Empty:
                return
            logging.getLogger(record.name).handle(record)
