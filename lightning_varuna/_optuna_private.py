"""The private Optuna APIs lightning-varuna relies on, all in one place (verified with optuna 5.0).

A sweep reads and marks trials of other workers by number, which Optuna's public API does only for the trials a
process asked itself (`optuna.trial.Trial`); the storage does it by trial id. A trial asked beyond the study's size
is given back unless it was enqueued (`was_enqueued`), which Optuna records in a system attribute of the trial.
tests/test_model_selection.py.

`optimize(processes=True)` forks worker processes that share the study through its storage, which a study keeps
private (`shareable_storage`); each becomes a worker of its own (`as_new_worker`): a journal names each log's writer
by an id its storage draws once, which a forked process would otherwise share with its parent (and read the
parent's logs as its own), and a database's connections must not be shared.
tests/test_model_selection.py.

The device scheduler ranks a trial by the time to its pruner's next decision (`multimodel/pruning.py`), which needs
the pruner's settings; Optuna keeps them in private attributes (`pruner_settings`). tests/test_multi_model.py.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna

__all__ = ["as_new_worker", "frozen_trial", "pruner_settings", "set_user_attr", "shareable_storage", "was_enqueued"]


def frozen_trial(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    """The trial ``number`` of ``study`` as the storage holds it now."""
    return study._storage.get_trial(_trial_id(study, number))


def set_user_attr(study: optuna.Study, number: int, key: str, value: Any) -> None:
    """Set a user attribute of trial ``number`` (running or waiting) of ``study``; raises if it has finished."""
    study._storage.set_trial_user_attr(_trial_id(study, number), key, value)


def was_enqueued(study: optuna.Study, number: int) -> bool:
    """Whether trial ``number`` of ``study`` was enqueued (`optuna.Study.enqueue_trial`), not drawn by the sampler."""
    return "fixed_params" in frozen_trial(study, number).system_attrs


def shareable_storage(study: optuna.Study) -> bool:
    """Whether other processes can share ``study`` through its storage: a journal or a database (cached or not)."""
    import optuna

    shared = (optuna.storages.JournalStorage, optuna.storages.RDBStorage)
    return any(isinstance(storage, shared) for storage in _storages(study))


def as_new_worker(study: optuna.Study) -> None:
    """In a forked process: make the study's storage this process's own. A journal gets a worker id of its own (the
    parent's would make each process take the other's logs for its own), and the database connections of the
    parent's pool are dropped without closing them for the parent (SQLAlchemy's advice for a pool inherited across
    a fork); the process opens its own. The sampler draws from a generator of its own, reseeded (as Optuna's
    ``n_jobs`` threads do): the parent's state, copied into every worker, would suggest the same parameters in each."""
    import optuna

    study.sampler.reseed_rng()
    for storage in _storages(study):
        if isinstance(storage, optuna.storages.JournalStorage):
            with storage._thread_lock:
                storage._worker_id_prefix = storage._replay_result._worker_id_prefix = f"{uuid.uuid4()}-"
                storage._replay_result._worker_id_to_owned_trial_id = {}
        elif isinstance(storage, optuna.storages.RDBStorage):
            storage.engine.dispose(close=False)


def _storages(study: optuna.Study) -> tuple[Any, ...]:
    """The study's storage and what it wraps, if anything (a cached storage's database, a journal's backend)."""
    return study._storage, getattr(study._storage, "_backend", None)


def _trial_id(study: optuna.Study, number: int) -> int:
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)


def pruner_settings(pruner: optuna.pruners.BasePruner, *names: str) -> tuple[Any, ...] | None:
    """The pruner's settings ``names`` (its constructor's arguments, e.g. ``"reduction_factor"``), None if it has
    not all of them."""
    values = tuple(getattr(pruner, f"_{name}", None) for name in names)
    return None if any(value is None for value in values) else values
