"""A checkpoint taken at any point of training resumes with the next sample: the resumed run trains the same
batches, with the same losses and weights, as an uninterrupted one (real processes, gloo).

The points: mid-epoch (a ModelCheckpoint every step), at the end of an epoch with validation (ModelCheckpoint saves
after it), and ``trainer.save_checkpoint`` after ``fit`` ended by ``max_epochs``, by ``max_steps`` within an epoch
and by ``max_steps`` at an epoch's end; with ``accumulate_grad_batches`` too.
"""

from __future__ import annotations

import os

import pytest
from reference import train_reference
from test_checkpoint_resume import EPOCHS, assert_continues, run, shape

# Real multi-process jobs; on one xdist worker, which then runs each module-scoped job once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("data_position")]


@pytest.fixture(scope="module")
def uninterrupted():
    result, weights = train_reference(shape(1, 1, epochs=EPOCHS))
    return result["losses"], weights


@pytest.fixture(scope="module")
def one_epoch_at_2x1(tmp_path_factory) -> str:
    """One epoch (3 steps) at (2, 1) with a checkpoint after every step, then `save_checkpoint` after the fit."""
    folder = tmp_path_factory.mktemp("one_epoch")
    every_step = {"dirpath": str(folder / "steps"), "save_top_k": -1}
    run(folder, "first", shape(2, 1, epochs=1, checkpoint_every_step=every_step, save_to=str(folder / "end.ckpt")))
    return str(folder)


@pytest.fixture(scope="module")
def three_steps_with_validation(tmp_path_factory) -> str:
    """``max_steps=3`` ends the fit at the first epoch's end, after its validation (ModelCheckpoint saves there)."""
    folder = tmp_path_factory.mktemp("max_steps_at_epoch_end")
    config = shape(
        2,
        1,
        epochs=EPOCHS,
        max_steps=3,
        validate_during_fit=True,
        checkpoint_dir=str(folder / "epochs"),
        save_to=str(folder / "end.ckpt"),
    )
    run(folder, "first", config)
    return str(folder)


def test_fit_continued_after_max_epochs_trains_the_next_epoch(tmp_path, one_epoch_at_2x1, uninterrupted):
    resume = os.path.join(one_epoch_at_2x1, "end.ckpt")
    result, weights = run(tmp_path, "resumed", shape(2, 1, epochs=EPOCHS, resume=resume))
    assert_continues(result, weights, uninterrupted, from_step=3)


def test_mid_epoch_checkpoint_continues_the_epoch(tmp_path, one_epoch_at_2x1, uninterrupted):
    resume = os.path.join(one_epoch_at_2x1, "steps", "epoch=0-step=1.ckpt")
    result, weights = run(tmp_path, "resumed", shape(1, 2, epochs=EPOCHS, resume=resume))
    assert_continues(result, weights, uninterrupted, from_step=1)


def test_fit_ended_by_max_steps_mid_epoch_continues_the_epoch(tmp_path, uninterrupted):
    end = str(tmp_path / "end.ckpt")
    run(tmp_path, "first", shape(1, 2, epochs=EPOCHS, max_steps=4, save_to=end))
    result, weights = run(tmp_path, "resumed", shape(2, 1, epochs=EPOCHS, resume=end))
    assert_continues(result, weights, uninterrupted, from_step=4)


@pytest.mark.parametrize(
    "checkpoint", ["end.ckpt", "epochs/epoch=0-step=3.ckpt"], ids=["save_checkpoint", "after_validation"]
)
def test_fit_ended_at_an_epoch_end_trains_the_next_epoch(
    tmp_path, three_steps_with_validation, uninterrupted, checkpoint
):
    resume = os.path.join(three_steps_with_validation, checkpoint)
    result, weights = run(tmp_path, "resumed", shape(2, 1, epochs=EPOCHS, resume=resume, validate_during_fit=True))
    assert_continues(result, weights, uninterrupted, from_step=3)


def test_accumulated_run_continues_after_max_epochs(tmp_path):
    """3 batches an epoch with ``accumulate_grad_batches=2``: optimizer steps after batches 2 and 3 of each epoch."""
    epochs = 3
    reference, final = train_reference(shape(1, 1, epochs=epochs, accumulate=2))
    end = str(tmp_path / "end.ckpt")
    run(tmp_path, "first", shape(2, 1, epochs=1, accumulate=2, save_to=end))
    result, weights = run(tmp_path, "resumed", shape(2, 1, epochs=epochs, accumulate=2, resume=end))
    assert_continues(result, weights, (reference["losses"], final), from_step=3)


def test_a_checkpoint_just_before_an_epoch_s_short_last_batch_resumes_at_another_shape(tmp_path):
    """14 rows in batches of 6: every epoch ends with a batch of 2 rows. A checkpoint taken just before it resumes
    with that batch, in micro-batches of 3 rows (chosen for the loader's whole batch; more than the 2 rows, which
    was refused as larger than the batch) and continues exactly."""
    short_last = {"rows": 14, "micro_batch_size": 3, "epochs": 2}
    reference, final = train_reference(shape(1, 1, **short_last))
    every_step = {"dirpath": str(tmp_path / "steps"), "save_top_k": -1}
    run(tmp_path, "first", shape(1, 1, **{**short_last, "epochs": 1}, checkpoint_every_step=every_step))
    resume = str(tmp_path / "steps" / "epoch=0-step=2.ckpt")
    result, weights = run(tmp_path, "resumed", shape(2, 1, **short_last, resume=resume))
    assert_continues(result, weights, (reference["losses"], final), from_step=2)
