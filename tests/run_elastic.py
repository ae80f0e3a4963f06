"""Train `TinyLM` the way an elastic job on preemptible machines does, under ``torchrun`` (any size) or SLURM.

    torchrun --nproc-per-node=N tests/run_elastic.py OUT_DIR '{"pipeline_parallel_size": 2, ...}'
    srun tests/run_elastic.py OUT_DIR '{"devices": N, ...}'     # in an sbatch job with --ntasks-per-node=N

The same script at every world size: ``global_batch_size`` fixes the training, ``MorphCallback`` writes to
``morph_dir``, a ModelCheckpoint writes to ``checkpoint_dir`` every ``every_n_steps`` steps, and ``fit`` always
resumes from ``"last"``. Without ``morph_dir`` the script adds no MorphCallback and calls ``fit`` without
``ckpt_path``, as a plain Lightning script under SLURM does. What each start of the workers did goes to
``OUT_DIR/attempt{restart}-world{size}/``: ``losses.json`` (rank 0: the logged loss of every step),
``samples_rank{r}.json`` (the dataset indices of every batch on first-stage ranks), ``rank{r}.pt`` (parameters by
name) and ``run.json`` (rank 0: how it ended).

Faults, on the first attempt only: ``"signal_at": {"rank": r, "step": s, "signal": "SIGUSR1"}`` makes rank
``r`` signal itself as step ``s`` starts; ``"kill_at": {"rank": r, "step": s}`` SIGKILLs rank ``r`` there;
``"signal_in_save": {"rank": r, "step": s}`` sends SIGUSR1 while rank ``r`` writes the checkpoint of step
``s``; ``"machines_at": {"step": s, "text": ...}`` rewrites the ``machine_list`` file then;
``"slow_steps_at_world": {"2": seconds}`` sleeps after each step at that world size, until a morph is
requested (a job waiting there for another machine to join); ``"slow_validation": seconds`` sleeps after each
validation batch. ``"signals"`` names the signals MorphCallback handles (default SIGUSR1). After its first step,
rank 0 writes its ``MASTER_ADDR`` to ``OUT_DIR/training-attempt{restart}-world{size}`` (``validating-...`` after
its first validation batch). With ``"validate_only": true`` the script validates instead of training and rank 0
writes the loss to ``OUT_DIR/validated-attempt{restart}``. ``"tempdir"`` is the strategy's
``checkpoint_tempdir``; ``"slow_uploads": seconds`` delays each file its background uploads write. With
``"pipeline_parallel_size": "auto"``, ``"profile"`` and ``"memory_budget"`` go to the strategy, which may train
spilled on one process (``run.json``'s ``"shape"`` is then ``"spilled"``, and ``"shards"`` says in how many);
``"dim"`` widens the model.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from models import RecordLosses, model_for, token_dataset  # noqa: E402
from upload_hooks import SlowUploads  # noqa: E402

from lightning_varuna import MorphCallback, VarunaStrategy  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", 0)))
WORLD = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
GLOBAL_VALIDATION_BATCH = 6


class Faults(L.Callback):
    """The faults of the config, injected on the first attempt."""

    def __init__(self, config: dict) -> None:
        self.config = config if ATTEMPT == 0 else {}

    def _at(self, trainer: L.Trainer, key: str) -> dict | None:
        fault = self.config.get(key)
        if fault and trainer.global_step == fault["step"] and trainer.global_rank == fault.get("rank", 0):
            return fault
        return None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if "signal_in_save" not in self.config or trainer.global_rank != self.config["signal_in_save"]["rank"]:
            return
        write_data = FileSystemWriter.write_data

        def write_then_signal(writer, plan, planner):  # noqa: ANN001, ANN202
            if self._at(trainer, "signal_in_save"):
                os.kill(os.getpid(), signal.SIGUSR1)
            return write_data(writer, plan, planner)

        FileSystemWriter.write_data = write_then_signal

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        if fault := self._at(trainer, "signal_at"):
            os.kill(os.getpid(), signal.Signals[fault.get("signal", "SIGUSR1")])
        if self._at(trainer, "kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault := self._at(trainer, "machines_at"):
            Path(self.config["machine_list"]).write_text(fault["text"])

    def on_validation_batch_end(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        time.sleep(self.config.get("slow_validation", 0))

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        deadline = time.monotonic() + self.config.get("slow_steps_at_world", {}).get(str(WORLD), 0)
        morph = next(cb for cb in trainer.callbacks if isinstance(cb, MorphCallback))
        while time.monotonic() < deadline and not morph.reasons:
            time.sleep(0.05)


class RecordSamples(L.Callback):
    """The dataset index of every row this first-stage rank trains on, batch by batch."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.index = {tuple(row.tolist()): i for i, row in enumerate(data.tensors[0])}
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:  # noqa: ANN001
        topology = getattr(trainer.strategy, "topology", None)  # None: trained spilled, one device
        if topology is None or topology.pp_rank == 0:
            self.batches.append([self.index[tuple(row.tolist())] for row in batch[0]])


class Started(L.Callback):
    """Tells whoever watches (a test starting another machine) that this attempt trains, and which machine hosts
    rank 0: a file after step 1."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        self._mark(trainer, "training")

    def on_validation_batch_end(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        self._mark(trainer, "validating")

    def _mark(self, trainer: L.Trainer, doing: str) -> None:
        marker = self.out_dir / f"{doing}-attempt{ATTEMPT}-world{WORLD}"
        if trainer.is_global_zero and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(os.environ.get("MASTER_ADDR", ""))


def main(out_dir: str, config: dict) -> None:
    L.seed_everything(config.get("seed", 0))
    model = model_for(config)
    data = token_dataset(config["rows"])
    record, samples = RecordLosses(), RecordSamples(data)
    callbacks = [record, samples, Started(Path(out_dir)), Faults(config)]
    if "slow_uploads" in config:
        callbacks.append(SlowUploads(config["slow_uploads"]))
    if "morph_dir" in config:
        signals = [signal.Signals[name] for name in config.get("signals", ["SIGUSR1"])]
        callbacks.append(
            MorphCallback(config["morph_dir"], signals, machine_list=config.get("machine_list"), poll_interval=0)
        )
    if "checkpoint_dir" in config:
        callbacks.append(
            ModelCheckpoint(
                dirpath=config["checkpoint_dir"], every_n_train_steps=config["every_n_steps"], save_top_k=-1
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=config.get("devices", "auto"),
        strategy=VarunaStrategy(
            pipeline_parallel_size=config["pipeline_parallel_size"],
            micro_batch_size=config["micro_batch_size"],
            global_batch_size=config["global_batch_size"],
            checkpoint_tempdir=config.get("tempdir"),
            profile=config.get("profile"),
            memory_budget=config.get("memory_budget"),
        ),
        max_epochs=config["epochs"],
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    if config.get("validate_only"):
        [metrics] = trainer.validate(model, DataLoader(data, batch_size=GLOBAL_VALIDATION_BATCH), verbose=False)
        if trainer.is_global_zero:
            (Path(out_dir) / f"validated-attempt{ATTEMPT}").write_text(json.dumps(metrics))
        return
    # The DataLoader's own batch size does not matter: the strategy re-batches to the global batch.
    trainer.fit(model, DataLoader(data, batch_size=1), ckpt_path="last" if "morph_dir" in config else None)

    out = Path(out_dir) / f"attempt{ATTEMPT}-world{WORLD}"
    out.mkdir(parents=True, exist_ok=True)
    rank = trainer.global_rank
    torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"rank{rank}.pt")
    (out / f"samples_rank{rank}.json").write_text(json.dumps(samples.batches))
    if trainer.is_global_zero:
        (out / "losses.json").write_text(json.dumps(record.losses))
        topology = getattr(trainer.strategy, "topology", None)
        morph = next(cb for cb in trainer.callbacks if isinstance(cb, MorphCallback))
        run = {
            "morphed": morph.morphed,
            "reasons": morph.reasons,
            "global_step": trainer.global_step,
            "shape": "spilled" if topology is None else [topology.pipeline_parallel_size, topology.data_parallel_size],
        }
        if topology is None:
            run["shards"] = len(trainer.strategy.shards)
        (out / "run.json").write_text(json.dumps(run))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
