"""Train `TinyLM` with VarunaStrategy in real processes and write what the parity tests compare.

    python tests/run_pipelined.py OUT_DIR '{"pipeline_parallel_size": 2, ...}'

Writes ``OUT_DIR/losses.json`` (rank 0: the logged train loss of every step) and ``OUT_DIR/rank{r}.pt``
(each rank's parameters by name).
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from models import TinyLM, token_dataset  # noqa: E402

from lightning_varuna import VarunaStrategy  # noqa: E402


class RecordLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(trainer.callback_metrics["train_loss"].item())


def main(out_dir: str, config: dict) -> None:
    L.seed_everything(config.get("seed", 0))
    model = TinyLM(scheduler=config.get("scheduler", False))
    pp, dp = config["pipeline_parallel_size"], config["data_parallel_size"]
    data = token_dataset(config["rows"])
    record = RecordLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=pp * dp,
        strategy=VarunaStrategy(
            pipeline_parallel_size=pp, micro_batch_size=config["micro_batch_size"], schedule=config["schedule"]
        ),
        max_epochs=config["epochs"],
        gradient_clip_val=config.get("clip"),
        accumulate_grad_batches=config.get("accumulate", 1),
        precision=config.get("precision", "32-true"),
        callbacks=[record],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=config["batch_size"]))
    os.makedirs(out_dir, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, f"{out_dir}/rank{trainer.global_rank}.pt")
    result = {"losses": record.losses, "acc": trainer.callback_metrics["train_acc"].item()}
    if config.get("evaluate"):
        loader = DataLoader(token_dataset(config["rows"], seed=2), batch_size=config["batch_size"])
        result["val_loss"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
        if pp * dp == pp:  # one replica: its predictions cover the whole set
            result["predictions"] = torch.cat(trainer.predict(model, loader)).tolist()
    if trainer.is_global_zero:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
