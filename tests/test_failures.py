"""A step the pipeline cannot run fails on every rank, a failed job ends with the failing rank's error last, and
ranks that wait for a pipeline message leave on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch.nn.functional as F
from conftest import JobTimedOut, children_of, clean_env, run_job, run_ranks
from models import TinyLM, token_dataset
from torch.utils.data import DataLoader

from lightning_varuna import VarunaStrategy
from lightning_varuna.pipeline.waiting import Waiter

RUNNER = os.path.join(os.path.dirname(__file__), "run_faulty_step.py")
SECOND_FORWARD = (
    r"TypeError: `\w+.training_step` called `self\(...\)` a second time on batch 1\. .*"
    r"Compute everything the step needs from one call's output"
)
NO_FORWARD = (
    r"TypeError: `\w+.training_step` returned without calling `self\(...\)` on batch 1\. .*"
    r"filter it out of the DataLoader, or \(in training\) multiply its loss by 0"
)
KILLED = r"PeerFailure: stopped \(RuntimeError: .*\) because rank 1 \(process \d+\) failed: killed by SIGKILL"
# The other rank may first see its connection to the failed rank break: it quotes that too, in parentheses.
UNPICKLABLE = r"TypeError: A pipelined step's results .* cannot be pickled \(.*lambda.*\)\. Return and log tensors"
STOPPED_BY = r"PeerFailure: stopped( \(.*\))? because rank {rank} \(pipeline stage {stage} of replica 0\) failed: "


class TwoForwards(TinyLM):
    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        idx, y = batch
        logits = self(idx) + self(idx) if batch_idx == 1 else self(idx)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class NoForward(TinyLM):
    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return self.head.weight.sum() * 0 if batch_idx == 1 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("model", "match"), [(TwoForwards(), SECOND_FORWARD), (NoForward(), NO_FORWARD)], ids=["two", "none"]
)
def test_a_step_with_other_than_one_forward_fails(model, match):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=VarunaStrategy(micro_batch_size=2),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(TypeError, match=match.removeprefix("TypeError: ")):
        trainer.fit(model, DataLoader(token_dataset(16), batch_size=4))


def test_a_blocked_wait_runs_signal_handlers_and_gives_up_when_on_wait_raises():
    waiter = Waiter("gloo")
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="gave up"):
        waiter.call(never.wait, on_wait=lambda: _raise(TimeoutError("gave up")))
    assert time.monotonic() - start < 2

    previous = signal.signal(signal.SIGALRM, lambda *_: _raise(KeyboardInterrupt("signal handled")))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt, match="signal handled"):
            waiter.call(never.wait)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert waiter.call(lambda: 42) == 42


def _raise(error: BaseException) -> None:
    raise error


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "ranks", "last_error", "other_rank_says"),
    [
        # The hang: only the last stage (rank 0) sees the second call; the first waited for its gradients for
        # ever. Rank 0 fails alone and lives on (it started the job): rank 1 learns of it while it waits.
        ("twice", "0", SECOND_FORWARD, STOPPED_BY.format(rank=0, stage=1) + SECOND_FORWARD),
        # Rank 1 fails alone: rank 0 ends the job with rank 1's error.
        ("skip", "1", STOPPED_BY.format(rank=1, stage=0) + NO_FORWARD, NO_FORWARD),
        ("skip", "0,1", NO_FORWARD, NO_FORWARD),
        # A rank killed by a signal leaves no notice: rank 0 names it from its exit status.
        ("die", "1", KILLED, None),
        # The last stage (rank 0) cannot send the step's results: it fails, and rank 1 learns of it while it waits.
        ("unpicklable", "0,1", UNPICKLABLE, STOPPED_BY.format(rank=0, stage=1) + UNPICKLABLE),
    ],
    ids=["second-forward", "no-forward-on-rank-1", "no-forward-on-all", "killed", "unpicklable-results"],
)  # fmt: skip
def test_a_failing_rank_ends_the_job_with_its_error_last(tmp_path, fault, ranks, last_error, other_rank_says):
    proc = run_job([RUNNER, fault, ranks], tmp_path, timeout=180)
    assert proc.returncode != 0
    lines = proc.stderr.rstrip().splitlines()
    assert re.search(last_error, lines[-1]), proc.stderr[-4000:]
    assert lines[-1].startswith("[rank0]:")  # the job's main process ends it
    if other_rank_says is not None:
        assert re.search(r"\[rank1\]: .*" + other_rank_says, proc.stderr), proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "stalled_rank", "signalled"),
    [("stall", 0, "job"), ("stall", 1, "job"), ("slow", 0, "job"), ("stall", 1, "rank 1")],
)
def test_sigterm_ends_ranks_that_wait_for_a_pipeline_message(tmp_path, fault, stalled_rank, signalled):
    # ``slow``: the last stage goes on with its step after the signal while the first gives up waiting for it, so
    # the last stage's gradient collectives (the tied weight's sum) must give up too. ``rank 1``: the signal reaches
    # rank 1 alone (not through Lightning's launcher); rank 0 learns of it from the job's notice.
    marker = tmp_path / "stalled"
    with open(tmp_path / "output.txt", "w") as output:
        job = subprocess.Popen(
            [sys.executable, RUNNER, fault, str(stalled_rank), str(marker)],
            cwd=tmp_path,
            env=clean_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    children = []
    try:
        _wait_for_file(marker, job, timeout_s=120)
        children = children_of(job.pid)
        time.sleep(1)  # the other stage now waits for the stalled one
        if signalled == "job":
            job.send_signal(signal.SIGTERM)  # Lightning's launcher passes it on to the other process
        else:
            os.kill(children[0], signal.SIGTERM)
        job.wait(timeout=15)  # raises if the job did not end
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)
    finally:
        for pid in [job.pid, *children]:
            _kill(pid)
    output_text = (tmp_path / "output.txt").read_text()
    assert "Received SIGTERM" in output_text
    assert "PeerFailure" not in output_text, output_text[-4000:]  # every rank stops as on SIGTERM, none as failed


def _wait_for_file(path: Path, job: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert job.poll() is None, f"the job ended before it stalled (exit code {job.returncode})"
        assert time.monotonic() < deadline, f"the job did not stall within {timeout_s} s"
        time.sleep(0.1)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


ON_EXCEPTION = """
import datetime, json, os, sys
sys.path.insert(0, {tests!r})
import lightning as L
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch.utils.data import DataLoader
from models import TinyLM, token_dataset
from lightning_varuna import VarunaStrategy


class FailsOnce(TinyLM):
    def training_step(self, batch, batch_idx):
        if {fail!r} == "training_step" and self.global_step == 3:
            raise RuntimeError("a bad batch")
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):  # as the step running out of memory, after the backward
        if {fail!r} == "optimizer_step" and self.global_step == 3:
            raise RuntimeError("a bad batch")


class Rank0Fails(L.Callback):  # as a logger that writes from rank 0 alone might
    def on_train_batch_end(self, trainer, *args):
        if {rank0_fails!r} and trainer.global_rank == 0 and trainer.global_step == 2:
            raise RuntimeError("a failure on rank 0 alone")


class Losses(L.Callback):
    losses = []

    def on_train_batch_end(self, trainer, *args):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


L.seed_everything(0)
strategy = VarunaStrategy(pipeline_parallel_size=2, timeout=datetime.timedelta(seconds=100))
callbacks = [Losses(), Rank0Fails(), OnExceptionCheckpoint({folder!r})]
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, callbacks=callbacks, logger=False,
                    enable_progress_bar=False)
try:
    trainer.fit(FailsOnce(), DataLoader(token_dataset(48), batch_size=8), ckpt_path={ckpt_path!r})
finally:
    with open(os.path.join({folder!r}, f"losses{{trainer.global_rank}}.json"), "w") as file:
        json.dump(Losses.losses, file)
"""


def run_on_exception_job(tmp_path: Path, name: str, fail: str | None, ckpt_path: str | None) -> list[list[float]]:
    """Run `ON_EXCEPTION` in ``tmp_path / name`` (failing in ``fail``, resuming from ``ckpt_path``); each rank's
    losses. A failing job runs under Lightning's launcher (how its processes end is the point), the others as
    forked ranks."""
    folder = tmp_path / name
    folder.mkdir()
    script = tmp_path / f"{name}.py"
    text = ON_EXCEPTION.format(
        tests=os.path.dirname(__file__), fail=fail, rank0_fails=False, folder=str(folder), ckpt_path=ckpt_path
    )
    script.write_text(text)
    proc = run_job([str(script)], tmp_path, timeout=300) if fail else run_ranks([str(script)], 2, tmp_path, timeout=300)
    assert (proc.returncode != 0) == bool(fail), proc.stderr[-3000:]
    if fail:
        assert "RuntimeError: a bad batch" in proc.stderr.rstrip().splitlines()[-1], proc.stderr[-3000:]
    return [json.loads((folder / f"losses{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_a_failed_step_leaves_an_on_exception_checkpoint_that_resumes_with_that_batch(tmp_path):
    """Under `Trainer(devices=N)` the main process saves `OnExceptionCheckpoint`'s checkpoint with the others before
    it waits for them to end (before, it waited first and then killed them, waiting in the save for it: no
    checkpoint); the job ends with the step's error, and the run resumed from the checkpoint trains the failed
    batch, as an uninterrupted run does (before, it skipped it), whether the step or its optimizer step failed
    (before, a batch whose optimizer step failed counted as trained)."""
    whole = run_on_exception_job(tmp_path, "whole", None, None)
    assert len(whole[0]) == 6
    for fail_in in ("training_step", "optimizer_step"):
        failed = run_on_exception_job(tmp_path, f"failed_in_{fail_in}", fail_in, None)
        checkpoint = str(tmp_path / f"failed_in_{fail_in}" / "on_exception.ckpt")
        resumed = run_on_exception_job(tmp_path, f"resumed_after_{fail_in}", None, checkpoint)
        for rank in (0, 1):
            assert failed[rank] == pytest.approx(whole[rank][:3], rel=1e-6), fail_in
            assert resumed[rank] == pytest.approx(whole[rank][3:], rel=1e-6), fail_in


@pytest.mark.slow
def test_a_failure_on_rank_0_alone_leaves_an_on_exception_checkpoint(tmp_path):
    """Rank 0 fails outside the pipelined step (a callback of its own): it tells the others before it saves with
    them (before, they went on to wait for its pipeline messages and it waited in the save until the process
    group's timeout, leaving no checkpoint)."""
    script = tmp_path / "job.py"
    text = ON_EXCEPTION.format(
        tests=os.path.dirname(__file__), fail=None, rank0_fails=True, folder=str(tmp_path), ckpt_path=None
    )
    script.write_text(text)
    proc = run_job([str(script)], tmp_path, timeout=90)
    assert proc.returncode != 0
    assert "RuntimeError: a failure on rank 0 alone" in proc.stderr.rstrip().splitlines()[-1], proc.stderr[-3000:]
    assert (tmp_path / "on_exception.ckpt").is_dir(), proc.stderr[-3000:]


@pytest.mark.slow  # waits for the job's hang to be found
@pytest.mark.parametrize("own_env", [False, True], ids=["forked-from-the-job-server", "fresh-python"])
def test_a_test_job_that_hangs_fails_with_where_each_of_its_processes_was(tmp_path, own_env):
    """The tests' own harness: a job past its timeout is stopped, and the failure shows its output and the stack of
    every thread of its Pythons, its children in sessions of their own included (as torchrun's workers), so that a
    hang in CI says where it hung."""
    script = tmp_path / "hangs.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "print('started', flush=True)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time\\ndef child_waits():\\n    time.sleep(60)\\n"
        "child_waits()'], start_new_session=True)\n"  # as torchrun starts its workers
        "def parent_waits():\n    time.sleep(60)\n"
        "parent_waits()\n"
    )
    with pytest.raises(JobTimedOut) as hung:
        run_job([str(script)], tmp_path, timeout=5, env={"HANGS": "1"} if own_env else None)
    message = str(hung.value)
    assert "did not end within 5 s" in message and "started" in message
    assert "in parent_waits" in message and "in child_waits" in message
