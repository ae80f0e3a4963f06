"""Plain single-device Lightning training on the global batches a pipelined run sees."""

from __future__ import annotations

import lightning as L
import torch
from models import TinyLM, token_dataset
from torch.utils.data import DataLoader, DistributedSampler


class RecordLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(trainer.callback_metrics["train_loss"].item())


class GlobalBatches(torch.utils.data.Sampler):
    """The union over replicas of what Lightning's DistributedSampler gives each replica, step by step."""

    def __init__(self, length: int, batch_size: int, replicas: int, seed: int) -> None:
        self.samplers = [
            DistributedSampler(range(length), replicas, r, shuffle=True, seed=seed) for r in range(replicas)
        ]
        self.batch_size = batch_size
        self.epoch = 0

    def __iter__(self):  # noqa: ANN204
        orders = []
        for sampler in self.samplers:
            sampler.set_epoch(self.epoch)
            orders.append(list(sampler))
        self.epoch += 1
        for start in range(0, len(orders[0]), self.batch_size):
            yield [i for order in orders for i in order[start : start + self.batch_size]]

    def __len__(self) -> int:
        return -(-len(self.samplers[0]) // self.batch_size)


def train_reference(config: dict) -> tuple[list[float], dict[str, torch.Tensor], float]:
    seed = config.get("seed", 0)
    L.seed_everything(seed)
    model = TinyLM(scheduler=config.get("scheduler", False))
    data = token_dataset(config["rows"])
    sampler = GlobalBatches(len(data), config["batch_size"], config["data_parallel_size"], seed)
    record = RecordLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
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
    trainer.fit(model, DataLoader(data, batch_sampler=sampler))
    result = {"losses": record.losses, "acc": trainer.callback_metrics["train_acc"].item()}
    if config.get("evaluate"):
        loader = DataLoader(token_dataset(config["rows"], seed=2), batch_size=config["batch_size"])
        result["val_loss"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
        result["predictions"] = torch.cat(trainer.predict(model, loader)).tolist()
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    return result, weights
