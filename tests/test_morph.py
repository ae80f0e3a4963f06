"""Job morphing: a signal or a change of machines checkpoints and stops the job; relaunched at another size
under torchrun it continues the same training, sample for sample (real processes, real signals, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import clean_env, run_job
from models import RecordLosses, TinyLM, token_dataset
from ports import free_port
from reference import train_reference
from torch.utils.data import DataLoader, DistributedSampler

from lightning_varuna import MorphCallback, SpillingStrategy, VarunaStrategy
from lightning_varuna.checkpoint.layout import open_complete
from lightning_varuna.slurm import requeue_job
from lightning_varuna.storage import Storage

pytestmark = pytest.mark.slow  # real multi-process jobs

RUNNER = os.path.join(os.path.dirname(__file__), "run_elastic.py")
GLOBAL_BATCH, ROWS, EPOCHS = 6, 24, 2  # 4 steps per epoch


def config(tmp_path, **extra) -> dict:
    return {
        "pipeline_parallel_size": 2,
        "micro_batch_size": 1,
        "global_batch_size": GLOBAL_BATCH,
        "rows": ROWS,
        "epochs": EPOCHS,
        "scheduler": True,
        "morph_dir": str(tmp_path / "morph"),
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "every_n_steps": 2,
        **extra,
    }


def torchrun(tmp_path, name: str, nproc: int, cfg: dict, *flags: str):  # noqa: ANN201
    """Run the elastic runner under torchrun; return the process and what each attempt wrote."""
    out = tmp_path / name
    # An explicit c10d rendezvous, as on real machines (`--standalone` restarts fail to reconnect gloo).
    rendezvous = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    args = ["-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}", *flags, RUNNER]
    proc = run_job([*args, str(out), json.dumps(cfg)], tmp_path)
    return proc, attempts_in(out)


def attempts_in(out: Path) -> list[dict]:
    """What each start of the workers wrote under ``out`` (see run_elastic.py), oldest first."""
    return [read_attempt(attempt) for attempt in sorted(out.glob("attempt*"), key=lambda path: path.stat().st_mtime)]


def read_attempt(attempt: Path) -> dict:
    """What one start of the workers wrote to its folder ``attempt``."""
    weights = {}
    for shard in attempt.glob("rank*.pt"):
        weights.update(torch.load(shard))
    samples = [json.loads(f.read_text()) for f in sorted(attempt.glob("samples_rank*.json"))]
    return {
        "run": json.loads((attempt / "run.json").read_text()),
        "losses": json.loads((attempt / "losses.json").read_text()),
        "weights": weights,
        "samples": [s for s in samples if s],  # first-stage ranks: one list per replica
    }


def global_batches(attempt: dict) -> list[list[int]]:
    """The rows of each step, over all replicas of the attempt."""
    return [sorted(i for replica in step for i in replica) for step in zip(*attempt["samples"])]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """Single-device training on the same global batches for all epochs, and those batches."""
    return uninterrupted_training()


def uninterrupted_training(**model: object) -> dict:
    """Single-device training of the model ``model`` describes (`model_for`), on the same global batches for all
    epochs, and those batches."""
    cfg = dict(pipeline_parallel_size=1, data_parallel_size=1, batch_size=GLOBAL_BATCH, rows=ROWS, **model)
    result, weights = train_reference({**cfg, "epochs": EPOCHS, "scheduler": True})
    sampler = DistributedSampler(range(ROWS), num_replicas=1, rank=0, shuffle=True, seed=0)
    batches = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches += [sorted(order[i : i + GLOBAL_BATCH]) for i in range(0, ROWS, GLOBAL_BATCH)]
    return {"losses": result["losses"], "weights": weights, "batches": batches}


def assert_same_training(attempts: list[dict], uninterrupted: dict, from_step: int) -> None:
    """The resumed attempt's losses, batches and final weights are those of the uninterrupted run."""
    resumed = attempts[-1]
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(uninterrupted["losses"][from_step:]), rtol=1e-5, atol=1e-5
    )
    assert global_batches(resumed) == uninterrupted["batches"][from_step:]
    assert resumed["weights"].keys() == uninterrupted["weights"].keys()
    for name, value in resumed["weights"].items():
        torch.testing.assert_close(value, uninterrupted["weights"][name], rtol=1e-4, atol=1e-5, msg=name)


def test_sigusr1_morphs_and_a_smaller_relaunch_continues_the_same_training(tmp_path, uninterrupted):
    """(2, 2) -> SIGUSR1 to one worker, arriving while it writes a periodic checkpoint -> (2, 1)."""
    cfg = config(tmp_path, signal_in_save={"rank": 1, "step": 2})
    proc, [first] = torchrun(tmp_path, "at-2x2", 4, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert first["run"] == {"morphed": True, "reasons": [], "global_step": 3, "shape": [2, 2]}, proc.stderr[-6000:]
    assert open_complete(Storage(), str(tmp_path / "checkpoints" / "epoch=0-step=2.ckpt")).global_step == 2
    morph = open_complete(Storage(), str(tmp_path / "morph" / "morph-step=3.ckpt"))
    assert morph.shape["data_position"] == {"epoch": 0, "rows": 3 * GLOBAL_BATCH, "shuffle": True, "seed": 0}
    assert first["losses"] == pytest.approx(uninterrupted["losses"][:3], rel=1e-5, abs=1e-5)
    assert global_batches(first) == uninterrupted["batches"][:3]

    proc, [resumed] = torchrun(tmp_path, "at-2x1", 2, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert resumed["run"]["shape"] == [2, 1]
    assert "morph-step=3.ckpt" in proc.stdout + proc.stderr
    assert_same_training([first, resumed], uninterrupted, from_step=3)
    # Measured: the epoch of the resize saw every sample exactly once, over both sizes.
    seen = [i for step in global_batches(first) + global_batches(resumed)[:1] for i in step]
    assert sorted(seen) == list(range(ROWS))


def test_killed_worker_restarts_from_the_last_periodic_checkpoint(tmp_path, uninterrupted):
    """SIGKILL at step 5 (no warning): torchrun restarts the workers, which resume from step 4's checkpoint."""
    cfg = config(tmp_path, kill_at={"rank": 1, "step": 5})
    proc, attempts = torchrun(tmp_path, "killed", 2, cfg, "--max-restarts=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert len(attempts) == 1, "the first attempt died before writing anything"
    assert "epoch=0-step=4.ckpt" in proc.stdout + proc.stderr
    assert_same_training(attempts, uninterrupted, from_step=4)


def test_machine_list_change_morphs_a_multi_process_job(tmp_path):
    """Every rank's host counts as running; rank 0 reads the list and all ranks morph together."""
    machines = tmp_path / "machines.txt"
    machines.write_text(f"{socket.gethostname()}\n")
    changed = {"step": 3, "text": f"{socket.gethostname()}\nspare-node-7\n"}
    cfg = config(tmp_path, machine_list=str(machines), machines_at=changed)
    proc, [attempt] = torchrun(tmp_path, "machines", 2, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert attempt["run"]["reasons"] == ["machine list changed: added ['spare-node-7'], removed []"]
    assert attempt["run"]["morphed"] and attempt["run"]["global_step"] == 4


def test_machine_list_change_and_preemption_notice_morph(tmp_path):
    """A host added to the machine list morphs the job; so does ``request`` from a notice watcher."""
    machines = tmp_path / "machines.txt"
    machines.write_text(f"# available\n{socket.gethostname()}\n")

    class ChangeMachines(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
            if trainer.global_step == 2:
                machines.write_text(f"{socket.gethostname()}\nspare-node-7\n")

    def fit(morph: MorphCallback, *callbacks: L.Callback) -> L.Trainer:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=VarunaStrategy(global_batch_size=GLOBAL_BATCH),
            max_epochs=EPOCHS,
            callbacks=[morph, *callbacks],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
        )
        trainer.fit(TinyLM(), DataLoader(token_dataset(ROWS), batch_size=1), ckpt_path="last")
        return trainer

    morph = MorphCallback(tmp_path / "morph", machine_list=str(machines), poll_interval=0)
    trainer = fit(morph, ChangeMachines())
    assert morph.morphed and trainer.global_step == 3
    assert morph.reasons == ["machine list changed: added ['spare-node-7'], removed []"]
    assert open_complete(Storage(), str(tmp_path / "morph" / "morph-step=3.ckpt")).global_step == 3

    class Notice(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
            if trainer.global_step == 5:
                morph.request("preemption notice: 30 s")

    morph = MorphCallback(tmp_path / "morph")
    trainer = fit(morph, Notice())
    assert morph.reasons == ["preemption notice: 30 s"]
    assert trainer.global_step == 6, "resumed from step 3, stopped after step 6"


def test_sigterm_morphs_when_morph_callback_handles_it(tmp_path):
    """torchrun's agent stops workers with SIGTERM when machines join or leave: with SIGTERM among its
    signals, MorphCallback (not Lightning's stop-without-checkpoint) handles it."""
    cfg = config(tmp_path, signals=["SIGUSR1", "SIGTERM"], signal_at={"rank": 1, "step": 4, "signal": "SIGTERM"})
    proc, [attempt] = torchrun(tmp_path, "sigterm", 2, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert attempt["run"]["morphed"] and attempt["run"]["global_step"] == 5
    assert open_complete(Storage(), str(tmp_path / "morph" / "morph-step=5.ckpt")).global_step == 5
    # torchrun shares its TCPStore (the default), with which a joining machine hangs: the job says so.
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in proc.stderr


def test_a_job_shrunk_to_one_process_trains_spilled_and_grows_back_into_a_pipeline(tmp_path):
    """4 -> 1 -> 2 processes under torchrun, one script and config: ``pipeline_parallel_size="auto"`` with a memory
    budget that the whole model does not fit. At 4 and 2 processes AutoConfig picks pipeline shapes that fit it; at 1,
    none does and the job trains spilled. Each launch resumes from the checkpoint the last one wrote at SIGUSR1, and
    the three together train exactly as one uninterrupted device does."""
    from test_auto_spilling import BUDGET, DIM, profile_with_spill_times

    profile = str(tmp_path / "profile.json")
    profile_with_spill_times(tmp_path).save(profile)
    cfg = config(tmp_path, pipeline_parallel_size="auto", profile=profile, memory_budget=BUDGET, dim=DIM)
    del cfg["checkpoint_dir"]
    reference = uninterrupted_training(dim=DIM)
    attempts = []
    for nproc, signal_at, resumed_from in ((4, 2, None), (1, 5, "morph-step=3.ckpt"), (2, None, "morph-step=6.ckpt")):
        launch = {**cfg, "signal_at": {"rank": nproc - 1, "step": signal_at}} if signal_at is not None else cfg
        proc, [attempt] = torchrun(tmp_path, f"at-{nproc}", nproc, launch)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert resumed_from is None or f"resuming from {tmp_path / 'morph' / resumed_from}" in proc.stderr
        attempts.append(attempt)
    first, spilled, grown = attempts
    assert first["run"]["shape"] in ([4, 1], [2, 2]) and first["run"]["morphed"]
    assert spilled["run"]["shape"] == "spilled" and spilled["run"]["shards"] > 1 and spilled["run"]["morphed"]
    assert grown["run"]["shape"] == [2, 1] and not grown["run"]["morphed"]
    assert [a["run"]["global_step"] for a in attempts] == [3, 6, EPOCHS * ROWS // GLOBAL_BATCH]
    losses = first["losses"] + spilled["losses"] + grown["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)
    assert global_batches(first) + global_batches(spilled) + global_batches(grown) == reference["batches"]
    assert_same_training(attempts, reference, from_step=6)


@pytest.mark.parametrize(
    ("first_addr", "joining_addr"),
    # The rendezvous ranks machines by address: the first machine keeps rank 0, or the new one takes it.
    [("127.0.0.1", "localhost"), ("localhost", "127.0.0.1")],
    ids=["first-keeps-rank-0", "joining-takes-rank-0"],
)
def test_a_machine_joining_grows_the_job_and_training_continues(tmp_path, uninterrupted, first_addr, joining_addr):
    """A second machine joins a running (2, 1) job (``--nnodes=1:2``; two torchrun agents on one host): the first
    agent SIGTERMs its workers, which write the morph checkpoint and exit; both agents re-rendezvous and the
    workers resume at (2, 2) with the same training."""
    cfg = config(tmp_path, signals=["SIGUSR1", "SIGTERM"], slow_steps_at_world={"2": 15})
    out = tmp_path / "grown"
    rendezvous = f"--rdzv-endpoint=127.0.0.1:{free_port()}"
    # last_call_timeout: the first machine starts alone after 1 s instead of waiting 30 s for a second one.
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2"]
    agent += ["--rdzv-backend=c10d", rendezvous, "--rdzv-conf=last_call_timeout=1", "--max-restarts=0"]
    job = [RUNNER, str(out), json.dumps(cfg)]
    # Without it the agents hang in the rendezvous of the grown job (torch 2.13; see the README).
    env = {**clean_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents, logs = [], [tmp_path / "first.log", tmp_path / "joining.log"]

    def start(addr: str, log: Path) -> subprocess.Popen:
        with log.open("w") as file:
            command = [*agent, f"--local-addr={addr}", *job]
            popen = subprocess.Popen(command, stdout=file, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        agents.append(popen)
        return popen

    try:
        first = start(first_addr, logs[0])
        deadline = time.monotonic() + 120
        while not (out / "training-attempt0-world2").exists():  # the first machine has trained a step
            assert first.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-6000:]
            time.sleep(0.1)
        joining = start(joining_addr, logs[1])
        codes = [first.wait(timeout=180), joining.wait(timeout=180)]
    finally:
        for popen in agents:  # on a failure: no agent outlives the test; SIGTERM makes it stop its workers
            if popen.poll() is None:
                popen.terminate()
        for popen in agents:
            try:
                popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                popen.kill()
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-8000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" not in output  # the warning of the shared store
    before, grown = attempts_in(out)
    step = before["run"]["global_step"]
    assert before["run"] == {"morphed": True, "reasons": ["received SIGTERM"], "global_step": step, "shape": [2, 1]}
    assert 1 <= step < EPOCHS * ROWS // GLOBAL_BATCH
    assert f"morph-step={step}.ckpt" in output
    assert open_complete(Storage(), str(tmp_path / "morph" / f"morph-step={step}.ckpt")).global_step == step
    assert before["losses"] == pytest.approx(uninterrupted["losses"][:step], rel=1e-5, abs=1e-5)
    assert global_batches(before) == uninterrupted["batches"][:step]
    assert grown["run"] == {"morphed": False, "reasons": [], "global_step": 8, "shape": [2, 2]}
    assert (out / "training-attempt0-world4").read_text() == min(first_addr, joining_addr), "rank 0's machine"
    assert_same_training([before, grown], uninterrupted, from_step=step)


def requeue_by_signal(slurm, tmp_path: Path, cfg: dict, started: str, env: dict[str, str]) -> tuple[str, str]:
    """Run run_elastic.py as a (2, 1) SLURM job; once rank 0 wrote ``started``, send SLURM's requeue signal to
    the job's tasks; return the job id and its output once the requeued job has finished."""
    out = tmp_path / "out"
    command = f"srun {sys.executable} {RUNNER} {out} '{json.dumps(cfg)}'"
    job = slurm.sbatch(command, "--job-name=requeue", "--ntasks-per-node=2", "--requeue", cwd=tmp_path, env=env)
    waiting = ("PENDING", "CONFIGURING", "RUNNING")
    marker = out / started
    slurm.wait_for(lambda: marker.exists() or slurm.job(job)["JobState"] not in waiting, 180, started)
    assert marker.exists(), slurm.output(job, tmp_path)[-6000:]

    subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env, check=True)
    slurm.wait_for(lambda: slurm.job(job)["Restarts"] == "1", 120, "the job to requeue itself")
    state = slurm.wait_until_ended(job, 240)
    output = slurm.output(job, tmp_path)
    assert state == "COMPLETED", output[-6000:]
    return job, output


def test_slurm_requeue_signal_checkpoints_requeues_and_the_job_resumes(tmp_path, slurm, uninterrupted):
    """A (2, 1) SLURM job of a plain Lightning script (no MorphCallback, ``fit`` without ``ckpt_path``) gets
    SLURM's requeue signal (SIGUSR1, as ``#SBATCH --signal=USR1@90`` sends it) while it trains: it checkpoints at
    the batch boundary, requeues itself once the checkpoint is committed, and the requeued job continues the same
    training from there."""
    # Saves go to a local folder first and are uploaded in the background, slowly: the requeue must wait for the
    # commit.
    cfg = config(tmp_path, devices=2, slow_steps_at_world={"2": 60}, tempdir=str(tmp_path / "local"), slow_uploads=1)
    del cfg["morph_dir"]
    # `scontrol` as the job sees it: first write down what the store holds at that moment.
    wrapper = tmp_path / "bin" / "scontrol"
    wrapper.parent.mkdir()
    real = shutil.which("scontrol")
    wrapper.write_text(f'#!/bin/sh\nls -R {tmp_path} > {tmp_path}/at-requeue.txt\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    env = {**clean_env(), "PATH": f"{wrapper.parent}:{os.environ['PATH']}"}
    job, output = requeue_by_signal(slurm, tmp_path, cfg, "training-attempt0-world2", env)

    [morph] = (tmp_path / "hpc_checkpoints" / job).iterdir()
    step = open_complete(Storage(), str(morph)).global_step
    assert morph.name == f"morph-step={step}.ckpt" and 1 <= step < EPOCHS * ROWS // GLOBAL_BATCH
    assert "COMMITTED.json" in (tmp_path / "at-requeue.txt").read_text(), "requeued before the commit"
    assert f"resuming from {morph}" in output
    resumed = read_attempt(tmp_path / "out" / "attempt1-world2")
    assert resumed["run"]["morphed"] is False and resumed["run"]["global_step"] == EPOCHS * ROWS // GLOBAL_BATCH
    assert_same_training([resumed], uninterrupted, from_step=step)


def test_slurm_requeue_signal_during_validation_requeues_at_once(tmp_path, slurm):
    """Outside ``fit`` the requeue signal requeues the job at once, without a checkpoint (there is nothing to
    resume), where Lightning's handler would save one from wherever the pipeline is; the job validates again."""
    cfg = config(tmp_path, devices=2, validate_only=True, slow_validation=60)
    del cfg["morph_dir"]
    requeue_by_signal(slurm, tmp_path, cfg, "validating-attempt0-world2", clean_env())
    out = tmp_path / "out"
    assert not (out / "validated-attempt0").exists()
    assert json.loads((out / "validated-attempt1").read_text())["val_loss"] > 0
    assert not list(tmp_path.glob("hpc*")), "no checkpoint"


@pytest.mark.parametrize("spilled", [False, True], ids=["varuna", "spilled"])
@pytest.mark.parametrize(
    ("own_signals", "added"),
    [(None, True), ([signal.SIGTERM], True), ([signal.SIGUSR1], False)],
    ids=["none", "own-for-sigterm", "own-for-sigusr1"],
)
def test_in_a_slurm_job_a_morph_callback_takes_the_requeue_signal(tmp_path, monkeypatch, own_signals, added, spilled):
    """In a SLURM allocation (one task: the variables srun sets), the trainer gets a MorphCallback for the
    requeue signal, writing under the job's id, unless one of its own handles that signal: pipelined, and spilled
    (where Lightning's own handler would save between two shards' optimizer steps)."""
    slurm_task = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NAME="train", SLURM_JOB_ID="42")
    slurm_task.update(SLURM_NODELIST="localhost", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    for name, value in {**slurm_task, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    own = [] if own_signals is None else [MorphCallback(tmp_path / "own", signal=own_signals)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SpillingStrategy(memory_budget="85KB") if spilled else VarunaStrategy(global_batch_size=GLOBAL_BATCH),
        max_steps=1,
        callbacks=own,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(TinyLM(), DataLoader(token_dataset(ROWS), batch_size=1))
    morphs = [cb for cb in trainer.callbacks if isinstance(cb, MorphCallback)]
    assert morphs[: len(own)] == own
    if added:
        assert [(cb.dirpath, cb.signals) for cb in morphs[len(own) :]] == [
            (str(tmp_path / "hpc_checkpoints" / "42"), [signal.SIGUSR1])
        ]
    else:
        assert morphs == own


def test_requeue_outside_slurm_fails_at_setup(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=VarunaStrategy(),
        max_steps=1,
        callbacks=[MorphCallback(tmp_path / "morph", requeue=True)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=False,
    )
    with pytest.raises(ValueError, match=r"requeue=True.*outside SLURM"):
        trainer.fit(TinyLM(), DataLoader(token_dataset(ROWS), batch_size=6))


def test_a_failed_requeue_says_how_to_resume(slurm, monkeypatch):
    """`scontrol requeue` refused (no such job) or not installed: a warning names the checkpoint, no crash."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("SLURM_JOB_ID", "999999")
    resume = r'fit\(ckpt_path="/ckpts/morph-step=3.ckpt"\)'
    with pytest.warns(UserWarning, match=r"`scontrol requeue 999999` failed \(exit code 1: .*" + resume):
        requeue_job("/ckpts/morph-step=3.ckpt")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.warns(UserWarning, match=r"`scontrol requeue 999999` failed \(.*No such file.*" + resume):
        requeue_job("/ckpts/morph-step=3.ckpt")


class SignalAfterBatch(L.Callback):
    """Sends this process ``signum`` after the first epoch's batch ``batch_idx``."""

    def __init__(self, signum: int, batch_idx: int) -> None:
        self.signum, self.batch_idx = signum, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if trainer.current_epoch == 0 and args[-1] == self.batch_idx:
            os.kill(os.getpid(), self.signum)


def test_a_morph_asked_for_between_the_batches_of_an_accumulated_step_waits_for_the_step(tmp_path):
    """Steps of 3 batches: a signal after batch 3 (one batch into the second step) morphs after batch 5, where the
    step ends, so the checkpoint loses no gradients and the resumed run trains as the uninterrupted one (one
    process, a real signal)."""

    def fit(model: TinyLM, callbacks: list[L.Callback], ckpt_path: str | None = None) -> RecordLosses:
        record = RecordLosses()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=VarunaStrategy(), max_epochs=2, accumulate_grad_batches=3,
            callbacks=[*callbacks, record], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, DataLoader(token_dataset(64), batch_size=8), ckpt_path=ckpt_path)
        return record

    torch.manual_seed(0)
    uninterrupted, morphed, resumed = TinyLM(), TinyLM(), TinyLM()
    morphed.load_state_dict(uninterrupted.state_dict())
    expected = fit(uninterrupted, []).losses
    morph = MorphCallback(tmp_path, signal=signal.SIGUSR1)
    before = fit(morphed, [SignalAfterBatch(signal.SIGUSR1, 3), morph]).losses
    assert morph.morphed and (tmp_path / "morph-step=2.ckpt").exists() and len(before) == 6
    after = fit(resumed, [], str(tmp_path / "morph-step=2.ckpt")).losses
    torch.testing.assert_close(before + after, expected, rtol=1e-5, atol=1e-6)
    for name, value in resumed.state_dict().items():
        torch.testing.assert_close(value, uninterrupted.state_dict()[name], rtol=1e-5, atol=1e-6, msg=name)
