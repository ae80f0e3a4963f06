"""A worker thread that moves finished local saves to remote storage while training goes on."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["BackgroundUploads"]


class BackgroundUploads:
    """Runs upload, commit and delete jobs one after another, in the order they were submitted."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, job: Callable[..., None], *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-varuna-upload")
        self._pending.append(self._pool.submit(job, *args))

    @property
    def in_flight(self) -> bool:
        return any(not job.done() for job in self._pending)

    def wait(self) -> BaseException | None:
        """Block until every submitted job has finished; return the first error, if any."""
        pending, self._pending = self._pending, []
        errors = [job.exception() for job in pending]
        return next((error for error in errors if error is not None), None)

    def close(self) -> BaseException | None:
        error = self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return error
