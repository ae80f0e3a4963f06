"""When a rank fails, every rank says which one failed and why, and the job ends with that error on screen last.

A failing rank leaves a notice in the job's key-value store (the default process group's) before its error unwinds:
its rank, its place in the pipeline and the error. The first notice of a job stays. The other ranks learn of it
while they wait for a pipeline message (the wait checks the store twice a second), or when a connection to the
failed rank breaks; either way they raise `PeerFailure`, which quotes the notice, instead of gloo's "Connection
closed by peer". `RunFailures` is a rank's part in this for one Trainer run.

Under Lightning's launch (``Trainer(devices=N)``) the main process is rank 0 and starts the others: its
`ReportFirstFailure` launcher runs the callbacks' ``on_exception`` with them (`OnExceptionCheckpoint` saves with
every process), then waits for them to end before it raises, so the last error on screen is the failing
rank's (in a `PeerFailure` if another rank failed). Lightning's own launcher kills every process as soon as one
failed, often before rank 0 printed anything; here that is the last resort after a grace period.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_varuna._lightning_private import TunerExitException, set_num_threads_if_needed
from lightning_varuna._torch_private import default_store
from lightning_varuna.hook_wrapping import restore_hooks, wrap_hook
from lightning_varuna.pipeline.topology import Topology

__all__ = ["Failure", "FailureNotice", "PeerFailure", "ReportFirstFailure", "RunFailures"]

log = logging.getLogger(__name__)

# How long the main process waits for the other processes of a failed job to end by themselves before killing them.
_CHILDREN_GRACE_S = 20.0


@dataclass(frozen=True)
class Failure:
    """The first failure of a job: which rank, where in the pipeline it ran, and its error; ``sigterm``: the rank
    stopped because it received SIGTERM."""

    rank: int
    where: str
    error: str
    sigterm: bool = False

    def __str__(self) -> str:
        return f"{self.where} failed: {self.error}"

    def stop(self, own_error: BaseException | None = None) -> BaseException:
        """What another rank raises when it learns of this failure: `SIGTERMException` after a SIGTERM (every rank
        stops as the signalled one did), else `PeerFailure`."""
        return SIGTERMException() if self.sigterm else PeerFailure(self, own_error)


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed first (`failure`)."""

    def __init__(self, failure: Failure, own_error: BaseException | None = None) -> None:
        self.failure = failure
        own = _describe(own_error) if own_error is not None else failure.error
        after = f" ({own.splitlines()[0][:160]}...)" if own != failure.error else ""
        super().__init__(f"stopped{after} because {failure}")


class FailureNotice:
    """Where the ranks leave and read the first failure of one Trainer run (``fit``, ``validate``...).

    Every rank makes one per run, in the same order, so that they share its key; a later run starts clean.
    Without a process group (or once the store's host is gone) there is nothing to leave or read: ``None``.
    """

    _runs = itertools.count()

    def __init__(self) -> None:
        self._key = f"lightning_varuna/first_failure/{next(FailureNotice._runs)}"

    def report(self, error: BaseException, where: str) -> Failure | None:
        """Leave ``error`` of this rank, unless another failure came first; return the first failure."""
        store = _store()
        if store is None:
            return None
        failure = Failure(dist.get_rank(), where, _describe(error), isinstance(error, SIGTERMException))
        notice = json.dumps(asdict(failure))
        try:
            return _parse(store.compare_set(self._key, "", notice))
        except Exception:  # noqa: BLE001 - the store's host may be gone: then there is nothing to report to
            return None

    def first(self) -> Failure | None:
        """The first failure of the run, if a rank reported one."""
        store = _store()
        try:
            return _parse(store.get(self._key)) if store and store.check([self._key]) else None
        except Exception:  # noqa: BLE001 - as above
            return None


class RunFailures:
    """One rank's part in the failures of one Trainer run: it leaves its own error in the run's `FailureNotice`, and
    gives up waiting for a peer when the job ended (this rank's SIGTERM, or another rank failed first).

    Args:
        trainer: the Trainer of the run (whose ``received_sigterm`` says that this rank was asked to end).
        rank: this process's global rank.
        topology: its place in the pipeline, named in its notice.
    """

    def __init__(self, trainer: pl.Trainer, rank: int, topology: Topology | None) -> None:
        self.notice = FailureNotice()
        self._trainer, self._rank = trainer, rank
        self._where = f"rank {rank}"
        if topology is not None:
            self._where += f" (pipeline stage {topology.pp_rank} of replica {topology.dp_rank})"

    def first(self) -> Failure | None:
        """The first failure of the run, if a rank reported one."""
        return self.notice.first()

    def report(self, error: BaseException) -> Failure | None:
        """Leave ``error`` for the other ranks unless another rank failed first; return the first failure."""
        return self.notice.report(error, self._where)

    def stop_if_job_ended(self) -> None:
        """Stop waiting for a peer on SIGTERM (this rank's, or another's that it left in the notice), or when another
        rank failed: what a wait for a peer calls while it waits."""
        if self._trainer.received_sigterm:
            raise SIGTERMException
        first = self.first()
        if first is not None and first.rank != self._rank:
            raise first.stop()

    @contextmanager
    def reported(self) -> Iterator[None]:
        """Leave an error of this rank's step for the other ranks; if another rank failed first (and this error
        follows from it: a connection to it broke), raise that failure instead."""
        try:
            yield
        except PeerFailure:
            raise
        except Exception as error:
            first = self.report(error)
            if first is not None and first.rank != self._rank:
                raise first.stop(error) from None
            raise


def _store() -> dist.Store | None:
    return default_store() if dist.is_available() and dist.is_initialized() else None


def _parse(notice: bytes) -> Failure:
    return Failure(**json.loads(notice))


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class ReportFirstFailure:
    """Mixin for Lightning's subprocess launcher: when the job fails, the main process (rank 0) waits for the
    others to end, then raises the job's first failure, so that it is the last error on screen."""

    cluster_environment: Any
    num_processes: int
    num_nodes: int
    procs: list[subprocess.Popen]

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Lightning's `launch`, with a more patient watch over the child processes.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        observer = None
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()  # type: ignore[attr-defined]
            observer = _ChildrenWatch(self.procs)
            observer.start()
        set_num_threads_if_needed(num_processes=self.num_processes)
        for callback in trainer.callbacks if trainer is not None else ():
            restore_hooks(callback)  # `on_exception` made a no-op by an earlier failed run, if its teardown did not
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            if observer is None or isinstance(error, TunerExitException):  # the tuner's normal end, on every rank
                raise
            if trainer is not None:
                _handle_failure_with_the_others(trainer, error)
            observer.stop()
            killed = _wait_for(self.procs, _CHILDREN_GRACE_S)
            # The strategy's failures of this run (VarunaStrategy's), if it has them.
            failures = getattr(trainer.strategy, "_failures", None) if trainer is not None else None
            cause = self._first_failure_of_others(error, failures, killed)
            if cause is None:
                raise
            raise cause from None

    def _first_failure_of_others(
        self, error: BaseException, failures: RunFailures | None, killed: dict[int, int]
    ) -> BaseException | None:
        """The error to end with when another process failed first (``None``: this process's own ``error``)."""
        if isinstance(error, PeerFailure):  # without the frames of the wait it gave up
            return error.with_traceback(None)
        if not isinstance(error, Exception):
            return None
        first = failures.first() if failures is not None else None
        if first is not None and first.rank != dist.get_rank():
            return first.stop(error)
        if not killed:
            return None
        # A process that a signal killed (the kernel's out-of-memory killer...) could not leave a notice.
        local_rank = min(killed)
        rank = self.cluster_environment.node_rank() * self.num_processes + local_rank
        where = f"rank {rank} (process {self.procs[local_rank - 1].pid})"
        cause = f"killed by {signal.Signals(killed[local_rank]).name}"
        if killed[local_rank] == signal.SIGKILL:
            cause += " (the kernel's out-of-memory killer sends it: `dmesg` shows whether it did)"
        return PeerFailure(Failure(rank, where, cause), error)


def _handle_failure_with_the_others(trainer: Any, error: BaseException) -> None:
    """Leave this process's notice for the others (the strategy's ``on_exception``: those waiting for a pipeline
    message stop), then run the callbacks' ``on_exception`` now, while the others are there (`OnExceptionCheckpoint`
    saves with every process). Lightning's own calls, after ``launch`` raises, then find the callbacks' part done
    (until the strategy's teardown gives them their hooks back)."""
    try:
        trainer.strategy.on_exception(error)
        for callback in trainer.callbacks:
            callback.on_exception(trainer, trainer.lightning_module, error)
    except Exception as failure:  # noqa: BLE001 - the job's own error is still the one to end with
        log.warning(f"Handling the job's failure failed too: {failure!r}")
    for callback in trainer.callbacks:
        wrap_hook(callback, "on_exception", _done)


def _done(hook: Any, *args: Any, **kwargs: Any) -> None:
    """A hook that has run already."""


def _wait_for(procs: list[subprocess.Popen], timeout_s: float) -> dict[int, int]:
    """Wait up to ``timeout_s`` for ``procs`` (local ranks 1, 2, ...) to end, then kill those left.

    Returns:
        By local rank, the signal that ended each process that a signal killed before this function had to.
    """
    deadline = time.monotonic() + timeout_s
    by_signal = {}
    for local_rank, proc in enumerate(procs, start=1):
        try:
            proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            log.warning(f"Process {proc.pid} did not end {timeout_s:.0f} s after the job failed: killing it.")
            proc.kill()
            proc.wait()
            continue
        if proc.returncode < 0:
            by_signal[local_rank] = -proc.returncode
    return by_signal


class _ChildrenWatch(threading.Thread):
    """Kills every process of the job (as Lightning's launcher does at once) when a child process failed and the
    main process has not ended the job itself `_CHILDREN_GRACE_S` later: it may be blocked for good in a collective
    that the child's end does not break."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        super().__init__(daemon=True, name="lightning-varuna-children")
        self._procs = procs
        self._stopped = threading.Event()

    def stop(self) -> None:
        """The main process ends the job itself."""
        self._stopped.set()

    def run(self) -> None:
        failed = None
        while failed is None and not self._stopped.wait(1.0):
            codes = [proc.poll() for proc in self._procs]
            if all(code == 0 for code in codes):
                return
            failed = next((proc for proc, code in zip(self._procs, codes) if code not in (None, 0)), None)
        if failed is None or self._stopped.wait(_CHILDREN_GRACE_S):
            return
        log.error(
            f"Process {failed.pid} ended with exit code {failed.returncode} and the job did not end within "
            f"{_CHILDREN_GRACE_S:.0f} s: killing all its processes."
        )
        for proc in self._procs:
            proc.kill()
        os.kill(os.getpid(), signal.SIGKILL)
