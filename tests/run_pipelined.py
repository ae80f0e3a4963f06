"""Train `TinyLM` with VarunaStrategy in real processes and write what the parity tests compare.

    python tests/run_pipelined.py OUT_DIR '{"pipeline_parallel_size": 2, ...}'

Writes ``OUT_DIR/losses.json`` (rank 0: the logged train loss of every step) and ``OUT_DIR/rank{r}.pt``
(each rank's parameters by name). With ``"checkpoint_dir"`` in the config, a ModelCheckpoint saves there
every epoch (and ``last``); ``"resume"`` is passed to ``fit(ckpt_path=...)``; ``"save_to"`` saves the final
state with ``trainer.save_checkpoint``.
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
from models import TinyLM, fit_and_report, token_dataset  # noqa: E402

from lightning_varuna import VarunaStrategy  # noqa: E402


def main(out_dir: str, config: dict) -> None:
    L.seed_everything(config.get("seed", 0))
    model = TinyLM(scheduler=config.get("scheduler", False))
    pp, dp = config["pipeline_parallel_size"], config["data_parallel_size"]
    strategy = VarunaStrategy(
        pipeline_parallel_size=pp,
        micro_batch_size=config["micro_batch_size"],
        schedule=config["schedule"],
        checkpoint_tempdir=config.get("tempdir"),
        storage_options=config.get("storage_options"),
    )
    loader = DataLoader(token_dataset(config["rows"]), batch_size=config["batch_size"])
    callbacks = []
    if "checkpoint_dir" in config:
        callbacks.append(
            ModelCheckpoint(dirpath=config["checkpoint_dir"], every_n_epochs=1, save_top_k=-1, save_last=True)
        )
    # With one replica, rank 0's predictions cover the whole set.
    trainer, result = fit_and_report(
        model,
        loader,
        config,
        predict=dp == 1,
        callbacks=callbacks,
        ckpt_path=config.get("resume"),
        devices=pp * dp,
        strategy=strategy,
    )
    if "save_to" in config:
        trainer.save_checkpoint(config["save_to"])
    os.makedirs(out_dir, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, f"{out_dir}/rank{trainer.global_rank}.pt")
    if trainer.is_global_zero:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
