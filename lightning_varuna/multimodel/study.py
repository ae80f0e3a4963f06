"""An Optuna study trained as one sweep (`MultiModelTrainer.optimize`): trials asked from the study train together,
their shards interleaved over the sweep's devices, each as if alone; a pruned trial ends at its next step boundary
and another is asked at once in its place; a preempted sweep leaves every running trial with a checkpoint that the
next run (or another worker) resumes; and the workers that share one storage each run their own trials.

How trials survive a worker. Each running trial says it is alive every ``heartbeat_interval`` seconds (a user
attribute of the trial, `HEARTBEAT`, so any storage carries it), and checkpoints itself every
``checkpoint_interval`` seconds at a step boundary. A trial whose worker was preempted (SIGTERM, SIGUSR1, Ctrl-C)
checkpoints at once and is *handed over*; a trial whose worker stopped saying it is alive for ``grace_period``
seconds (killed) is handed over by another worker, from its last checkpoint. Handing over is Optuna's own retry:
the trial is told FAIL (atomic in every storage: of two workers taking over one trial, one succeeds) with the
attribute `HANDED_OVER`, and a trial with the same parameters is enqueued carrying `RESUMES` (the trial it continues
and its checkpoint). Whichever worker asks next gets it, resumes from that checkpoint, and reports the intermediate
values of the trial it continues first, so the pruner sees one history. Handed-over trials do not count as failures
toward ``n_trials``.

How the study keeps its size. A worker asks for a trial while the study holds fewer than ``n_trials``; two workers
that count at the same moment may both ask. The trial numbered beyond ``n_trials`` among those that count is then
given back before it is built: told FAIL with the attribute `SURPLUS`, and not counted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from queue import Empty, Queue
from typing import TYPE_CHECKING, Any, Protocol

from lightning_varuna._optuna_private import frozen_trial, set_user_attr, was_enqueued
from lightning_varuna.checkpoint.layout import IncompleteCheckpointError, open_complete
from lightning_varuna.multimodel.report import ModelResult, StudyDisplay
from lightning_varuna.multimodel.trial_callback import TrialCallback
from lightning_varuna.partition.packing import format_bytes
from lightning_varuna.spilling.planning import available_host_bytes
from lightning_varuna.storage import Storage, join

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import optuna

__all__ = [
    "CHECKPOINT",
    "HANDED_OVER",
    "HEARTBEAT",
    "RESUMES",
    "SURPLUS",
    "StudyRunner",
    "Sweep",
    "TrialOutcome",
    "progress_line",
    "row_name",
]

log = logging.getLogger(__name__)

HEARTBEAT = "lightning_varuna.heartbeat"  # when the worker running the trial last said it runs (seconds, UTC epoch)
CHECKPOINT = "lightning_varuna.checkpoint"  # the URL of the trial's checkpoint
RESUMES = "lightning_varuna.resumes"  # of a retry: {"trial": the number it continues, "checkpoint": that one's URL}
HANDED_OVER = "lightning_varuna.handed_over"  # of a trial continued by a retry: why ("preempted", "no heartbeat")
SURPLUS = "lightning_varuna.surplus"  # of a trial asked beyond n_trials as another worker asked too: never built
IDLE_POLL_S = 0.1  # how often a worker with no trial of its own looks whether others' trials still run (the study
# ends this late after its last trial at most: a worker that has nothing to do waits for the others' trials to end)


@dataclass
class TrialOutcome:
    """How a trial this worker ran ended: ``state`` is "complete", "pruned", "failed" or "handed over"."""

    number: int
    params: dict[str, Any]
    state: str
    value: float | None
    steps: int
    seconds: float


class Sweep(Protocol):
    """What a study's trials train in (`MultiModelTrainer`): a trial is added as a model, launched alongside those
    training, and forgotten once its fit has ended."""

    storage_options: dict[str, Any] | None

    def add(
        self,
        model: pl.LightningModule,
        *,
        ckpt_path: str | None,
        name: str,
        next_decision: Callable[[pl.Trainer], tuple[float, float]],
        **kwargs: Any,
    ) -> pl.Trainer:
        """Add ``model`` with what `Trainer(...)` and `Trainer.fit` take for it, and when its pruner next decides;
        return its Trainer."""
        ...

    def launch(self, trainer: pl.Trainer, ended: Callable[[ModelResult], None]) -> ModelResult:
        """Start fitting the model of ``trainer``; ``ended(result)`` runs once its fit has ended."""
        ...

    def forget(self, trainer: pl.Trainer) -> None:
        """Drop the model of ``trainer`` (its fit has ended)."""
        ...

    def measured_bytes(self, trainer: pl.Trainer) -> int:
        """What the model of ``trainer`` was measured to need (its parameters until its set-up measured it)."""
        ...

    def building(self) -> AbstractContextManager[None]:
        """While the block builds a model, no model of the sweep draws from torch's global generator or restores
        its state."""
        ...


@dataclass
class _Running:
    trial: optuna.trial.Trial
    callback: TrialCallback
    result: ModelResult | None = None  # set as its fit starts


class StudyRunner:
    """Runs ``study``'s trials in ``sweep`` until the study holds ``n_trials`` trials (see the module).

    Args:
        sweep: what the trials train in (a `MultiModelTrainer`).
        study: the Optuna study (one objective).
        build: ``build(trial)`` returns what `MultiModelTrainer.add` takes (``model`` and the rest, by name).
        n_trials: the study's size: trials are asked while it holds fewer (finished, running or waiting; handed-over
            ones not counted), over every run and worker.
        monitor: the logged value the study optimizes, reported after every validation.
        value: ``"last"`` or ``"best"`` reported value as the trial's.
        checkpoint_dir: where each trial's checkpoint goes (any fsspec URL; shared by the workers).
        checkpoint_interval: seconds between a trial's checkpoints.
        heartbeat_interval: seconds between a running trial's heartbeats.
        grace_period: seconds without a heartbeat after which a trial is taken over.
        max_running: the most trials training at once in this worker.
        preempted: set by a signal: running trials checkpoint and are handed over; no more are asked.
        display: where the running trials and the study's progress show, if anywhere.
        idle: told whether the worker has nothing to train (no trial left to ask, it waits for others' trials), and
            when it trains again (`LentCores.set_idle`).
    """

    def __init__(
        self,
        sweep: Sweep,
        study: optuna.Study,
        build: Callable[[optuna.trial.Trial], dict[str, Any]],
        n_trials: int,
        monitor: str,
        value: str,
        checkpoint_dir: str,
        checkpoint_interval: float,
        heartbeat_interval: float,
        grace_period: float,
        max_running: int,
        preempted: threading.Event,
        display: StudyDisplay | None = None,
        idle: Callable[[bool], None] | None = None,
    ) -> None:
        import optuna

        self._optuna = optuna
        self.sweep, self.study, self.build = sweep, study, build
        self.n_trials, self.monitor, self.value = n_trials, monitor, value
        self.checkpoint_dir, self.checkpoint_interval = checkpoint_dir.rstrip("/"), checkpoint_interval
        self.heartbeat_interval, self.grace_period = heartbeat_interval, grace_period
        self.max_running, self.preempted, self.display, self.idle = max_running, preempted, display, idle
        self.minimize = study.direction == optuna.study.StudyDirection.MINIMIZE
        self.outcomes: list[TrialOutcome] = []
        self._running: dict[int, _Running] = {}  # by trial number
        self._ended: Queue[int] = Queue()
        self._largest_bytes = 0  # the most that a trial of this worker was measured to need
        self._held_back = False  # whether a trial waited for host memory (said once)
        self._storage = Storage(sweep.storage_options)

    # ------------------------------------------------------------------------------------------------- the loop
    def run(self) -> list[TrialOutcome]:
        """Ask, train and tell trials until the study is complete or the sweep is preempted; return this worker's."""
        with self._heartbeats():
            while True:
                self._take_over_silent_trials()
                while (
                    not self.preempted.is_set()
                    and len(self._running) < self.max_running
                    and self._memory_holds_another()
                    and self._start_next()
                ):
                    pass
                if self.idle is not None:
                    self.idle(not self._running)
                if not self._running and (self.preempted.is_set() or not self._others_may_need_us()):
                    return self.outcomes
                # Nothing ended: time to look for silent trials again (soon, if this worker only waits for others').
                wait = self.heartbeat_interval if self._running else min(self.heartbeat_interval, IDLE_POLL_S)
                with contextlib.suppress(Empty):
                    self._end(self._ended.get(timeout=wait))

    def _memory_holds_another(self) -> bool:
        """Whether host memory has room for one more trial beside those running: as much available as the most that
        one of this worker's trials was measured to need. With none running, a trial starts whatever is available."""
        if not self._running:
            return True
        running = [r.result.trainer for r in self._running.values() if r.result is not None]
        self._largest_bytes = max([self._largest_bytes, *(self.sweep.measured_bytes(t) for t in running)])
        available = available_host_bytes()
        if available >= self._largest_bytes:
            return True
        if not self._held_back:
            log.info(
                f"{len(self._running)} trial(s) train while {format_bytes(available)} of host memory is available, "
                f"less than a trial was measured to need ({format_bytes(self._largest_bytes)}): the next trial "
                "starts once one ends."
            )
        self._held_back = True
        return False

    def _start_next(self) -> bool:
        """Ask the study for a trial (a retry waiting to be resumed first) and start training it; False if the
        study is full."""
        if self._size() >= self.n_trials and not self._waiting():
            return False
        if self.idle is not None:  # its core, if lent, is taken back before the trial is built
            self.idle(False)
        trial = self.study.ask()
        if self._give_back_if_surplus(trial):
            return False
        resumes = trial.user_attrs.get(RESUMES)
        url = join(self.checkpoint_dir, f"trial-{trial.number}")
        trial.set_user_attr(CHECKPOINT, url)
        trial.set_user_attr(HEARTBEAT, time.time())
        callback = TrialCallback(trial, self.monitor, url, self.checkpoint_interval, self.preempted, self.minimize)
        running = self._running[trial.number] = _Running(trial, callback)
        try:
            ckpt_path = self._resume_point(trial, resumes, callback)
            # The build seeds and initializes while other trials train; `add` takes the generator's state it left.
            with self.sweep.building():
                kwargs = _what_add_takes(self.build(trial))
                model = kwargs.pop("model")
                kwargs["callbacks"] = [*(kwargs.pop("callbacks", None) or []), callback]
                name = row_name(trial)
                trainer = self.sweep.add(
                    model, ckpt_path=ckpt_path, name=name, next_decision=callback.next_decision, **kwargs
                )
        except self._optuna.TrialPruned:
            self._tell(running, "pruned", 0, 0.0)
            return True
        except Exception as error:  # noqa: BLE001 - a trial that cannot be built fails alone
            self._fail(running, error, 0, 0.0)
            return True
        if self.display is not None:
            self.display.watch(name, self.monitor, lambda: callback.last)
        running.result = self.sweep.launch(trainer, lambda result: self._ended.put(trial.number))
        return True

    def _resume_point(self, trial: optuna.trial.Trial, resumes: dict | None, callback: TrialCallback) -> str | None:
        """Where a retry resumes: the checkpoint of the trial it continues, whose reports it makes its own; None
        for a new trial (or one killed before its first checkpoint)."""
        if resumes is None:
            return None
        continued = frozen_trial(self.study, resumes["trial"])
        for step, value in sorted(continued.intermediate_values.items()):
            trial.report(value, step)
            callback.reported_steps.add(step)
            callback.last = value
            callback.keep_if_best(value)
        try:
            open_complete(self._storage, resumes["checkpoint"])
        except IncompleteCheckpointError:
            log.warning(
                f"Trial {trial.number} continues trial {resumes['trial']}, which left no checkpoint: it starts over."
            )
            return None
        log.info(
            f"Trial {trial.number} continues trial {resumes['trial']} from its checkpoint {resumes['checkpoint']}."
        )
        return resumes["checkpoint"]

    # ------------------------------------------------------------------------------------------- trials that end
    def _end(self, number: int) -> None:
        running = self._running[number]
        result, callback = running.result, running.callback
        assert result is not None
        self._largest_bytes = max(self._largest_bytes, self.sweep.measured_bytes(result.trainer))
        self.sweep.forget(result.trainer)
        if callback.handed_over:
            self._record(running, "handed over", result.steps, result.seconds)
        elif callback.pruned and result.status != "failed":  # (at the validation as it was preempted too)
            self._tell(running, "pruned", result.steps, result.seconds)
        elif callback.interrupted or result.status == "stopped":
            if callback.save_error is not None:
                log.warning(
                    f"Trial {number} was preempted but could not checkpoint ({type(callback.save_error).__name__}: "
                    f"{callback.save_error}); its retry resumes from its last complete checkpoint, or starts over."
                )
            self._hand_over(running.trial.number, "preempted", running.trial.params, callback.checkpoint_url)
            self._record(running, "handed over", result.steps, result.seconds)
        elif result.status == "failed":
            self._fail(running, result.error, result.steps, result.seconds)
        else:
            self._tell(running, "complete", result.steps, result.seconds)

    def _tell(self, running: _Running, state: str, steps: int, seconds: float) -> None:
        value, last = running.callback.value(self.value), running.callback.last
        if state == "complete" and (value is None or math.isnan(value)):
            if last is None and running.callback.logged_instead is not None:
                why = (
                    f"the trial logged no `{self.monitor}` after its validations, but "
                    f"{running.callback.logged_instead}: log it, or pass the name that is logged as `monitor`"
                )
            elif last is None:
                why = f"the trial logged no `{self.monitor}` (it ran no validation)"
            else:  # the best of values none of which is a number, or a last one that is not
                why = f"the trial's {self.value} `{self.monitor}` is not a number (its last: {last})"
            self._fail(running, ValueError(why), steps, seconds)
        elif state == "pruned":
            self._finish(running, state, steps, seconds, state=self._optuna.trial.TrialState.PRUNED)
        else:
            self._finish(running, state, steps, seconds, value, values=value)

    def _fail(self, running: _Running, error: BaseException | None, steps: int, seconds: float) -> None:
        message = f"{type(error).__name__}: {error}"
        with contextlib.suppress(Exception):  # finished meanwhile (handed over): the reason is not needed then
            running.trial.set_user_attr("fail_reason", message)
        if self._finish(running, "failed", steps, seconds, state=self._optuna.trial.TrialState.FAIL):
            traceback = error if error is not None and error.__traceback__ is not None else None
            log.warning(f"Trial {running.trial.number} failed: {message}", exc_info=traceback)

    def _finish(
        self, running: _Running, ended_as: str, steps: int, seconds: float, value: float | None = None, **tell: Any
    ) -> bool:
        """Tell the study that the trial ended as ``ended_as`` (``tell``: `optuna.Study.tell`'s arguments) and record
        it; False if another worker had told it first (handed it over, having heard from it too late): it is recorded
        as handed over then, its retry carrying on."""
        try:
            self.study.tell(running.trial, **tell)
        except (self._optuna.exceptions.UpdateFinishedTrialError, ValueError):  # the storage's or Optuna's refusal
            if not frozen_trial(self.study, running.trial.number).state.is_finished():
                raise
            self._record(running, "handed over", steps, seconds)
            return False
        self._record(running, ended_as, steps, seconds, value)
        return True

    def _record(self, running: _Running, state: str, steps: int, seconds: float, value: float | None = None) -> None:
        trial = running.trial
        self.outcomes.append(TrialOutcome(trial.number, dict(trial.params), state, value, steps, seconds))
        del self._running[trial.number]
        if self.display is not None:
            self.display.ended(row_name(trial), state)  # its row says how it ended: "pruned", "failed"...
            self.display.summary(self._progress())

    def _progress(self) -> str:
        return progress_line(self.study.study_name, self.outcomes, self.monitor, self.minimize)

    # ------------------------------------------------------------------------------------------- handing over
    def _hand_over(self, number: int, why: str, params: dict[str, Any], checkpoint: str) -> bool:
        """Tell trial ``number`` FAIL as handed over and enqueue its retry; False if another worker told it first."""
        TrialState = self._optuna.trial.TrialState
        try:
            set_user_attr(self.study, number, HANDED_OVER, why)
            self.study.tell(number, state=TrialState.FAIL)
        except Exception:  # noqa: BLE001 - finished meanwhile: its worker or another one told it
            return False
        self.study.enqueue_trial(params, user_attrs={RESUMES: {"trial": number, "checkpoint": checkpoint}})
        log.info(f"Trial {number} handed over ({why}); a retry with its parameters resumes from {checkpoint}.")
        return True

    def _take_over_silent_trials(self) -> None:
        """Hand over the running trials of other workers that have not said they are alive for ``grace_period``."""
        now = time.time()
        for trial in self.study.get_trials(deepcopy=False, states=(self._optuna.trial.TrialState.RUNNING,)):
            beat = trial.user_attrs.get(HEARTBEAT)
            if trial.number in self._running or beat is None or now - beat <= self.grace_period:
                continue
            self._hand_over(trial.number, "no heartbeat", trial.params, trial.user_attrs[CHECKPOINT])

    @contextmanager
    def _heartbeats(self) -> Iterator[None]:
        """Say the running trials are alive every ``heartbeat_interval`` seconds while the block runs, from a thread
        of its own: a `build` that takes long, or one that waits for another trial's set-up to give back torch's
        generator, holds up the loop, not the heartbeats, so no other worker takes live trials over meanwhile."""
        done = threading.Event()

        def beat() -> None:
            while True:
                self._beat()
                if done.wait(self.heartbeat_interval):
                    return

        thread = threading.Thread(target=beat, name="lightning_varuna-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _beat(self) -> None:
        """Say the running trials are alive; one that another worker took over (told FAIL: it had no heartbeat for
        too long) ends at its next step boundary."""
        now = time.time()
        for running in list(self._running.values()):
            try:
                running.trial.set_user_attr(HEARTBEAT, now)
            except Exception:  # noqa: BLE001 - finished: another worker handed it over
                running.callback.handed_over = True  # it ends at its next step boundary

    # ---------------------------------------------------------------------------------------------- counting
    def _size(self) -> int:
        return len(self._counted())

    def _counted(self) -> list[optuna.trial.FrozenTrial]:
        """The trials that count toward ``n_trials``: one per line of a trial and its retries (the trial that
        started it, handed over or not: a retry counts in its place, whenever it is enqueued), none given back as
        surplus."""
        trials = self.study.get_trials(deepcopy=False)
        return [t for t in trials if SURPLUS not in t.user_attrs and RESUMES not in t.user_attrs]

    def _give_back_if_surplus(self, trial: optuna.trial.Trial) -> bool:
        """Give back ``trial`` if the sampler drew it beyond ``n_trials``: other workers asked at the same moment,
        and at least ``n_trials`` trials that count are numbered before it. A trial that was waiting (a retry, one
        the user enqueued) is always run."""
        if was_enqueued(self.study, trial.number):
            return False
        before = sum(1 for t in self._counted() if t.number < trial.number)
        if before < self.n_trials:
            return False
        trial.set_user_attr(SURPLUS, True)
        self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
        log.info(
            f"Trial {trial.number} was asked while other workers asked too, beyond the study's {self.n_trials} "
            "trials: it is given back unbuilt (told FAIL, marked surplus, not counted)."
        )
        return True

    def _waiting(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(self._optuna.trial.TrialState.WAITING,)))

    def _others_may_need_us(self) -> bool:
        """Whether trials of the sweep run on other workers: one may die and leave them to be taken over here."""
        running = self.study.get_trials(deepcopy=False, states=(self._optuna.trial.TrialState.RUNNING,))
        return any(CHECKPOINT in trial.user_attrs for trial in running) or self._waiting()


def progress_line(study_name: str, outcomes: list[TrialOutcome], monitor: str, minimize: bool) -> str:
    """The study's line of the display: its trials by state, and its best value so far."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.state] = counts.get(outcome.state, 0) + 1
    done = [o for o in outcomes if o.state == "complete" and o.value is not None]
    best = (min if minimize else max)(done, key=lambda o: o.value, default=None)  # type: ignore[arg-type, return-value]
    text = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    if best is not None:
        text += f"; best {monitor} {best.value:.4g} (trial {best.number})"
    return f"study {study_name}: {text}"


def row_name(trial: optuna.trial.Trial | optuna.trial.FrozenTrial) -> str:
    """A trial's row in the display: its number and parameters."""
    params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    return f"trial {trial.number} ({params})" if params else f"trial {trial.number}"


_THE_TRIALS = ("ckpt_path", "name", "next_decision")  # what `add` takes that the study sets for each trial


def _what_add_takes(built: object) -> dict[str, Any]:
    """What ``build(trial)`` returned, as `MultiModelTrainer.add`'s arguments; a clear error for anything else."""
    if not isinstance(built, Mapping) or "model" not in built:
        raise TypeError(
            "`build(trial)` returns what `MultiModelTrainer.add` takes, as a dict: `dict(model=..., "
            f"train_dataloaders=..., max_steps=...)`; it returned {type(built).__name__}"
            + (f" with keys {sorted(built)}" if isinstance(built, Mapping) else "")
        )
    theirs = sorted(set(built) & set(_THE_TRIALS))
    if theirs:
        raise ValueError(
            f"`build(trial)` returned {theirs}, which the study sets for each trial: its name (the trial's number and "
            "parameters), where it resumes (its own checkpoint under `checkpoint_dir`, when a preempted trial "
            "continues) and when its pruner decides next (`next_decision`)."
        )
    return dict(built)
