"""`MultiModelTrainer.optimize` with ``processes=True``: the study's trials trained in D worker processes forked as
it starts, each a one-device sweep pinned to a core of its own and a worker of the study, as a worker on another
machine would be (sharing its storage, taking over a dead worker's trials). Trials whose steps are mostly Python
(small models on the CPU) then do not wait for one another's interpreter lock, as threads of one process do."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from lightning_varuna._optuna_private import forget_connections, shareable_storage
from lightning_varuna.multimodel.devices import cores_for
from lightning_varuna.multimodel.processes import ended_at_exit, picklable
from lightning_varuna.multimodel.signals import handled
from lightning_varuna.multimodel.study import TrialOutcome

if TYPE_CHECKING:
    import optuna

__all__ = ["optimize_in_processes"]

log = logging.getLogger(__name__)


def optimize_in_processes(
    study: optuna.Study, devices: int, run_worker: Callable[[], list[TrialOutcome]]
) -> list[TrialOutcome]:
    """Run ``run_worker`` (a one-device sweep's `optimize` of ``study``) in each of ``devices`` forked processes;
    return how the trials they ran ended. SIGTERM, SIGUSR1 and Ctrl-C are passed on to them."""
    if not shareable_storage(study):
        raise ValueError(
            "`processes=True` trains the trials in worker processes that share the study through its storage, and a "
            "study in memory cannot be shared: create it with a storage (a journal file, "
            '`optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend("study.log"))`, or a '
            'database URL such as "sqlite:///study.db").'
        )
    cores = cores_for(devices)
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe(duplex=False) for _ in range(devices)]
    workers = [
        context.Process(target=_work, args=(study, run_worker, k, cores, pipes), name=f"study worker {k}")
        for k in range(devices)
    ]
    for worker in workers:
        worker.start()
    for _, sending in pipes:
        sending.close()

    def pass_on(signum: int, frame: Any) -> None:  # Ctrl-C as SIGTERM: a terminal's Ctrl-C reaches them too
        for worker in workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM)  # type: ignore[arg-type]

    outcomes: list[TrialOutcome] = []
    errors: list[BaseException] = []
    with handled((signal.SIGINT, signal.SIGTERM, signal.SIGUSR1), pass_on), ended_at_exit(workers):
        for k, (receiving, _) in enumerate(pipes):
            try:
                kind, payload = receiving.recv()
            except EOFError:  # it died without a word (killed): the other workers take over its trials
                workers[k].join()
                log.warning(
                    f"Study worker process {k} died (exit code {workers[k].exitcode}); the other workers take over "
                    "its running trials after the grace period, from their last checkpoints (or the next run does)."
                )
                continue
            if kind == "outcomes":
                outcomes.extend(payload)
            else:
                errors.append(payload)
    if errors:
        raise errors[0]
    return sorted(outcomes, key=lambda outcome: outcome.number)


def _work(
    study: optuna.Study,
    run_worker: Callable[[], list[TrialOutcome]],
    k: int,
    cores: list[int] | None,
    pipes: list[tuple[Connection, Connection]],
) -> None:
    """Worker process ``k``: pinned to ``cores[k]``, run the study; send back how its trials ended (or its error)."""
    sending = pipes[k][1]
    for end in (end for pipe in pipes for end in pipe if end is not sending):
        end.close()  # so that each worker's pipe reads as closed once that worker has ended
    if cores is not None:
        os.sched_setaffinity(0, {cores[k]})
    forget_connections(study)
    try:
        sending.send(("outcomes", run_worker()))
    except BaseException as error:  # noqa: BLE001 - sent to the sweep's process, which raises it
        sending.send(("error", picklable(error)))
