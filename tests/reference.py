"""Plain single-device Lightning training on the global batches a pipelined run sees."""

from __future__ import annotations

import lightning as L
import torch
from models import fit_and_report, model_for, token_dataset
from torch.utils.data import DataLoader, DistributedSampler


class GlobalBatches(torch.utils.data.Sampler):
    """The union over replicas of what Lightning's DistributedSampler gives each replica, step by step."""

    def __init__(self, length: int, batch_size: int, replicas: int, seed: int, first_epoch: int = 0) -> None:
        self.samplers = [
            DistributedSampler(range(length), replicas, r, shuffle=True, seed=seed) for r in range(replicas)
        ]
        self.batch_size = batch_size
        self.epoch = first_epoch

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


def train_reference(
    config: dict, ckpt_path: str | None = None, first_epoch: int = 0
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train on one device (resuming from ``ckpt_path``, taken at the end of epoch ``first_epoch - 1``); return the
    results `fit_and_report` gives and the final weights."""
    seed = config.get("seed", 0)
    L.seed_everything(seed)
    model = model_for(config)
    data = token_dataset(config["rows"])
    sampler = GlobalBatches(len(data), config["batch_size"], config["data_parallel_size"], seed, first_epoch)
    loader = DataLoader(data, batch_sampler=sampler)
    _, result = fit_and_report(model, loader, config, predict=True, ckpt_path=ckpt_path, devices=1)
    return result, {k: v.detach().clone() for k, v in model.named_parameters()}
