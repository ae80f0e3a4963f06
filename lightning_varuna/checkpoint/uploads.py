"""A worker thread that moves finished local saves to remote storage while training goes on."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["BackgroundUploads"]


class BackgroundUploads:
    """Runs upload, commit and delete jobs one after another, in the order they were submitted.

    Once a job fails, the jobs submitted after it are skipped until `wait` reports the failure: a checkpoint
    queued for deletion behind an upload that failed stays, since the upload did not replace it.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._failed = False

    def submit(self, job: Callable[..., None], *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-varuna-upload")
        self._pending.append(self._pool.submit(self._run_unless_failed, job, *args))

    def _run_unless_failed(self, job: Callable[..., None], *args: Any) -> None:
        if self._failed:
            return
        try:
            job(*args)
        except BaseException:
            self._failed = True
            raise

    @property
    def in_flight(self) -> bool:
        return any(not job.done() for job in self._pending)

    def wait(self) -> BaseException | None:
        """Block until every submitted job has finished; return the first error, if any."""
        pending, self._pending = self._pending, []
        errors = [job.exception() for job in pending]
        self._failed = False
        return next((error for error in errors if error is not None), None)

    def close(self) -> BaseException | None:
        error = self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return error
