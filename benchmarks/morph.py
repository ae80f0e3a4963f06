"""Time to morph: from the signal to training again at the new size.

Run from the repository root (about 3 minutes on 2 CPU cores)::

    python benchmarks/morph.py

examples/gpt.py's GPT at 8 layers x dim 768 (57 M parameters, 230 MB of weights; with AdamW's two moments the
checkpoint holds about 690 MB) trains under ``torchrun`` at (P, D) = (2, 2) on 4 processes with a global batch
of 8 and ``MorphCallback``. After a few steps this script sends SIGUSR1 to one worker. The job writes its
on-demand checkpoint to a local folder and exits; the script relaunches the same command on 2 processes, which
resumes at (2, 1) from that checkpoint. Measured from outside, by wall clock:

* ``signal -> checkpoint committed``: until the checkpoint's commit marker is on the store;
* ``signal -> job exited``: until torchrun returned (exit code 0);
* ``relaunch -> first step``: from starting torchrun on the new size until its first training step ended
  (process start, rendezvous, partitioning, loading the checkpoint, one step);
* ``signal -> first step``: the whole morph.

Cloud preemption notices give 30 s (Azure, GCP) to 2 minutes (AWS); the on-demand checkpoint must fit well
inside the first. Figures go to ``benchmarks/results/morph.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from lightning.fabric.plugins.environments.lightning import find_free_network_port

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "morph.json")
GLOBAL_BATCH, MAX_STEPS, SIGNAL_AFTER = 8, 8, 3


def worker(folder: str) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from gpt import GPT, CharDataset, make_text

    from lightning_varuna import MorphCallback, VarunaStrategy

    torch.set_num_threads(1)
    L.seed_everything(0)
    data = CharDataset(make_text(), block_size=64)
    model = GPT(len(data.vocab), block_size=64, dim=768, layers=8, heads=12)

    class Progress(L.Callback):
        """Rank 0 reports each finished step; every rank reports its pid."""

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            with open(os.path.join(folder, f"pid{trainer.global_rank}"), "w") as f:
                f.write(str(os.getpid()))

        def on_train_batch_end(self, trainer: L.Trainer, *_) -> None:  # noqa: ANN002
            if trainer.is_global_zero:
                with open(os.path.join(folder, "progress.jsonl"), "a") as f:
                    f.write(json.dumps({"step": trainer.global_step, "time": time.time()}) + "\n")

    trainer = L.Trainer(
        accelerator="cpu",
        strategy=VarunaStrategy(pipeline_parallel_size=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH),
        max_steps=MAX_STEPS,
        callbacks=[Progress(), MorphCallback(os.path.join(folder, "morph"))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=1), ckpt_path="last")


def torchrun(nproc: int, folder: str) -> subprocess.Popen:
    port = find_free_network_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d"]
    command += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--nproc-per-node={nproc}", __file__, "--worker", folder]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, "log"), "a"))


def steps(folder: str) -> list[dict]:
    path = os.path.join(folder, "progress.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def wait_for(condition, what: str, job: subprocess.Popen, timeout: float = 600) -> float:  # noqa: ANN001
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline or (job.poll() not in (None, 0)):
            raise RuntimeError(f"no {what} (job exit code {job.poll()}); see the torchrun log")
        time.sleep(0.02)
    return time.time()


def committed(folder: str) -> bool:
    morph = os.path.join(folder, "morph")
    return os.path.isdir(morph) and any(name == "COMMITTED.json" for _, _, names in os.walk(morph) for name in names)


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return

    with tempfile.TemporaryDirectory() as folder:
        print("training at (2, 2) on 4 processes ...", flush=True)
        job = torchrun(4, folder)
        wait_for(lambda: len(steps(folder)) >= SIGNAL_AFTER, f"step {SIGNAL_AFTER}", job)
        before = steps(folder)
        step_time = (before[-1]["time"] - before[1]["time"]) / (len(before) - 2)
        with open(os.path.join(folder, "pid1")) as f:
            pid = int(f.read())
        signalled = time.time()
        os.kill(pid, signal.SIGUSR1)
        print(f"SIGUSR1 to rank 1 after step {before[-1]['step']}", flush=True)
        committed_at = wait_for(lambda: committed(folder), "committed checkpoint", job)
        exit_code = job.wait()
        exited = time.time()
        stopped_at = steps(folder)[-1]["step"]
        print(f"job exited with {exit_code} at step {stopped_at}; relaunching on 2 processes at (2, 1) ...")
        relaunched = time.time()
        job = torchrun(2, folder)
        resumed_at = wait_for(lambda: len(steps(folder)) > len(before) + (stopped_at - before[-1]["step"]), "step", job)
        first = steps(folder)[-1]
        job.wait()
        results = {
            "checkpoint MB": folder_mb(os.path.join(folder, "morph")),
            "step before (s)": step_time,
            "signal -> checkpoint committed (s)": committed_at - signalled,
            "signal -> job exited (s)": exited - signalled,
            "relaunch -> first step (s)": resumed_at - relaunched,
            "signal -> first step (s)": resumed_at - signalled,
            "exit code": exit_code,
            "stopped after step": stopped_at,
            "resumed step": first["step"],
        }
    for name, value in results.items():
        print(f"  {name:<38}{value:>10.2f}" if isinstance(value, float) else f"  {name:<38}{value:>10}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
