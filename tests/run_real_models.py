"""Train models of `real_models` one after another with VarunaStrategy, in the processes torchrun (or
`forked_ranks`) started.

    torchrun --nproc-per-node=N tests/run_real_models.py OUT_DIR '{"models": [...], "pipeline_parallel_size": P, ...}'

For each model writes ``OUT_DIR/<model>/losses.json`` (rank 0: the logged train loss of every step) and
``OUT_DIR/<model>/rank{r}.pt`` (each rank's parameters and buffers by name). With ``"save_every": K`` it also writes
a checkpoint every K steps to ``OUT_DIR/<model>/checkpoints`` (the newest also as ``last.ckpt``); with
``"resume_from": DIR`` it resumes from ``DIR/<model>/last.ckpt``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from models import RecordLosses  # noqa: E402
from real_models import build  # noqa: E402

from lightning_varuna import VarunaStrategy  # noqa: E402


def train(name: str, out_dir: str, config: dict, devices: int) -> None:
    model, data = build(name)
    strategy = VarunaStrategy(
        pipeline_parallel_size=config["pipeline_parallel_size"],
        micro_batch_size=config["micro_batch_size"],
        schedule=config.get("schedule", "1f1b"),
        stages_per_rank=config.get("stages_per_rank", 1),
    )
    record = RecordLosses()
    folder = os.path.join(out_dir, name)
    callbacks: list[L.Callback] = [record]
    if "save_every" in config:
        callbacks.append(ModelCheckpoint(folder, every_n_train_steps=config["save_every"], save_last=True))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=config["steps"],
        precision=config.get("precision", "32-true"),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing="save_every" in config,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = config.get("resume_from")
    ckpt_path = None if resume is None else os.path.join(resume, name, "last.ckpt")
    trainer.fit(model, DataLoader(data, batch_size=config["batch_size"]), ckpt_path=ckpt_path)
    os.makedirs(folder, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(folder, f"rank{trainer.global_rank}.pt"))
    if trainer.is_global_zero:
        with open(os.path.join(folder, "losses.json"), "w") as f:
            json.dump(
                {
                    "losses": record.losses,
                    "shape": [strategy.topology.pipeline_parallel_size, strategy.topology.data_parallel_size],
                },
                f,
            )


if __name__ == "__main__":
    out, config = sys.argv[1], json.loads(sys.argv[2])
    # One node: every rank the launcher started (read before the first fit, whose teardown may unset it).
    devices = int(os.environ["WORLD_SIZE"])
    for model_name in config["models"]:
        train(model_name, out, config, devices)
