"""The private Optuna APIs lightning-varuna relies on, all in one place (verified with optuna 5.0).

A sweep reads and marks trials of other workers by number, which Optuna's public API does only for the trials a
process asked itself (`optuna.trial.Trial`); the storage does it by trial id. tests/test_model_selection.py.

The device scheduler ranks a trial by the time to its pruner's next decision (`multimodel/pruning.py`), which needs
the pruner's settings; Optuna keeps them in private attributes (`pruner_settings`). tests/test_multi_model.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna

__all__ = ["frozen_trial", "pruner_settings", "set_user_attr"]


def frozen_trial(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    """The trial ``number`` of ``study`` as the storage holds it now."""
    return study._storage.get_trial(_trial_id(study, number))


def set_user_attr(study: optuna.Study, number: int, key: str, value: Any) -> None:
    """Set a user attribute of trial ``number`` (running or waiting) of ``study``; raises if it has finished."""
    study._storage.set_trial_user_attr(_trial_id(study, number), key, value)


def _trial_id(study: optuna.Study, number: int) -> int:
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)


def pruner_settings(pruner: optuna.pruners.BasePruner, *names: str) -> tuple[Any, ...] | None:
    """The pruner's settings ``names`` (its constructor's arguments, e.g. ``"reduction_factor"``), None if it has
    not all of them."""
    values = tuple(getattr(pruner, f"_{name}", None) for name in names)
    return None if any(value is None for value in values) else values
