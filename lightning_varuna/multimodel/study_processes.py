"""`MultiModelTrainer.optimize` with ``processes=True``: the study's trials trained in D worker processes forked as
it starts, each a one-device sweep pinned to a core of its own and a worker of the study, as a worker on another
machine would be (sharing its storage, taking over a dead worker's trials). Trials whose steps are mostly Python
(small models on the CPU) then do not wait for one another's interpreter lock, as threads of one process do. A worker
left with no trial to ask lends its core to those still training (`CoreLending`)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from contextlib import nullcontext
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

from lightning_varuna._optuna_private import as_new_worker, shareable_storage
from lightning_varuna.multimodel.core_lending import CoreLending, LentCores
from lightning_varuna.multimodel.devices import cores_for
from lightning_varuna.multimodel.processes import ended_at_exit, own_end, picklable, start_forked
from lightning_varuna.multimodel.report import StudyDisplay
from lightning_varuna.multimodel.signals import handled
from lightning_varuna.multimodel.study import HANDED_OVER, SURPLUS, TrialOutcome, progress_line, row_name
from lightning_varuna.multimodel.worker_logs import WorkerLogs

if TYPE_CHECKING:
    import optuna

__all__ = ["optimize_in_processes"]

log = logging.getLogger(__name__)


SHOWN_EVERY_S = 0.5  # how often the display reads the study's storage


def optimize_in_processes(
    study: optuna.Study,
    devices: int,
    run_worker: Callable[[LentCores | None], list[TrialOutcome]],
    monitor: str,
    rows: int,
    pin: bool = True,
) -> list[TrialOutcome]:
    """Run ``run_worker`` (a one-device sweep's `optimize` of ``study``) in each of ``devices`` forked processes,
    each pinned to a core of its own, which it lends while it has no trial (``pin=False``: the OS places them, and
    none lends); return how the trials they ran ended. SIGTERM, SIGUSR1 and Ctrl-C are passed on to them. With
    ``rows``, a display shows the study as its storage has it: that many rows for running trials (their steps and
    ``monitor`` as of their last report), and the study's line."""
    if not shareable_storage(study):
        raise ValueError(
            "`processes=True` trains the trials in worker processes that share the study through its storage, and a "
            "study in memory cannot be shared: create it with a storage (a journal file, "
            '`optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend("study.log"))`, or a '
            'database URL such as "sqlite:///study.db").'
        )
    cores = cores_for(devices) if pin else None
    context = multiprocessing.get_context("fork")
    lending = CoreLending(cores, context) if cores is not None else None
    pipes = [context.Pipe(duplex=False) for _ in range(devices)]
    logs = WorkerLogs(context) if rows else None
    workers = [
        context.Process(target=_work, args=(study, run_worker, k, lending, pipes, logs), name=f"study worker {k}")
        for k in range(devices)
    ]
    start_forked(workers)
    for _, sending in pipes:
        sending.close()

    def pass_on(signum: int, frame: Any) -> None:  # Ctrl-C as SIGTERM: a terminal's Ctrl-C reaches them too
        for worker in workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM)  # type: ignore[arg-type]

    outcomes: list[TrialOutcome] = []
    errors: list[BaseException] = []
    display = StudyDisplay(rows, study.study_name) if rows else None
    view = _StoredStudyView(study, display, monitor) if display is not None else None
    waiting = {receiving: k for k, (receiving, _) in enumerate(pipes)}
    with (
        handled((signal.SIGINT, signal.SIGTERM, signal.SIGUSR1), pass_on),
        display.logs_above() if display is not None else nullcontext(),
        ended_at_exit(workers, logs),
    ):
        while waiting:
            for receiving in cast(list[Connection], wait(list(waiting), timeout=SHOWN_EVERY_S)):
                k = waiting.pop(receiving)
                if lending is not None:  # it has ended (its one message says how), or died: its core is free
                    lending.set_idle(k, True)
                try:
                    kind, payload = receiving.recv()
                except EOFError:  # it died without a word (killed): the other workers take over its trials
                    workers[k].join()
                    log.warning(
                        f"Study worker process {k} died (exit code {workers[k].exitcode}); the other workers take "
                        "over its running trials after the grace period, from their last checkpoints (or the next "
                        "run does)."
                    )
                    continue
                if kind == "outcomes":
                    outcomes.extend(payload)
                else:
                    errors.append(payload)
            if logs is not None:
                logs.print_sent()
            if view is not None:
                try:
                    view.show()
                except Exception as error:  # noqa: BLE001 - the display must not end the study
                    log.warning(f"The study's display stops: reading its storage failed ({error}).")
                    view = None
    if display is not None:
        display.close()
    if errors:
        raise errors[0]
    return sorted(outcomes, key=lambda outcome: outcome.number)


class _StoredStudyView:
    """Shows on ``display`` what the study's storage says: a row per running trial (its steps and ``monitor`` as of
    its last report), how each shown trial ended, and the study's line."""

    def __init__(self, study: optuna.Study, display: StudyDisplay, monitor: str) -> None:
        import optuna

        self.study, self.display, self.monitor, self._states = study, display, monitor, optuna.trial.TrialState
        self.minimize = study.direction == optuna.study.StudyDirection.MINIMIZE
        self.shown: dict[int, str] = {}  # trial number -> its row's name

    def show(self) -> None:
        trials = [t for t in self.study.get_trials(deepcopy=False) if SURPLUS not in t.user_attrs]  # never trained
        for trial in trials:
            if trial.state == self._states.RUNNING:
                self._running(trial)
            elif trial.number in self.shown:  # its row shows its last reported step, then how it ended
                self.display.stepped(self.shown[trial.number], max(trial.intermediate_values, default=0), None)
                self.display.ended(self.shown.pop(trial.number), self._ended_as(trial))
        finished = [self._outcome(t) for t in trials if t.state.is_finished()]
        self.display.summary(progress_line(self.study.study_name, finished, self.monitor, self.minimize))

    def _running(self, trial: optuna.trial.FrozenTrial) -> None:
        name = row_name(trial)
        if trial.number not in self.shown:
            if not self.display.has_free_row():
                return
            self.shown[trial.number] = name
            self.display.started(name, float("inf"), 0)
        reported = trial.intermediate_values
        last_step = max(reported, default=0)
        self.display.watch(name, self.monitor, lambda: reported.get(last_step))
        self.display.stepped(name, last_step, None)

    def _ended_as(self, trial: optuna.trial.FrozenTrial) -> str:
        if trial.state == self._states.FAIL:
            return "handed over" if HANDED_OVER in trial.user_attrs else "failed"
        return trial.state.name.lower()

    def _outcome(self, trial: optuna.trial.FrozenTrial) -> TrialOutcome:
        steps = max(trial.intermediate_values, default=0)
        return TrialOutcome(trial.number, trial.params, self._ended_as(trial), trial.value, steps, 0.0)


def _work(
    study: optuna.Study,
    run_worker: Callable[[LentCores | None], list[TrialOutcome]],
    k: int,
    lending: CoreLending | None,
    pipes: list[tuple[Connection, Connection]],
    logs: WorkerLogs | None,
) -> None:
    """Worker process ``k``: pinned to its core (and those lent to it), run the study; send back how its trials
    ended (or its error). Where the calling process displays the study, the worker's log lines and warnings go to it
    as ``logs``, less Lightning's lines of each fit (its cut, `max_steps` reached), one set per trial."""
    if logs is not None:
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
        logs.send_from_here()
    sending = own_end(pipes, k)
    lent = lending.of(k) if lending is not None else None
    if lent is not None:
        lent.use(borrowing=False)  # pinned to its own core; only the sweep's threads borrow (see `core_lending`)
    as_new_worker(study)
    try:
        outcomes = run_worker(lent)
        sending.send(("outcomes", outcomes))
    except BaseException as error:  # noqa: BLE001 - sent to the sweep's process, which raises it
        sending.send(("error", picklable(error)))
