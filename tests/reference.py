"""Plain single-device Lightning training on the global batches a pipelined run sees."""

from __future__ import annotations

import lightning as L
import torch
from models import fit_and_report, model_for, token_dataset
from torch.utils.data import DataLoader

from lightning_varuna.comparing import GlobalBatches


def train_reference(
    config: dict, ckpt_path: str | None = None, first_epoch: int = 0
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train on one device (resuming from ``ckpt_path``, taken at the end of epoch ``first_epoch - 1``); return the
    results `fit_and_report` gives and the final weights."""
    seed = config.get("seed", 0)
    L.seed_everything(seed)
    model = model_for(config)
    data = token_dataset(config["rows"])
    sampler = GlobalBatches(
        len(data),
        batch_size=config["batch_size"],
        data_parallel_size=config["data_parallel_size"],
        seed=seed,
        first_epoch=first_epoch,
    )
    loader = DataLoader(data, batch_sampler=sampler)
    _, result = fit_and_report(model, loader, config, predict=True, ckpt_path=ckpt_path, devices=1)
    return result, {k: v.detach().clone() for k, v in model.named_parameters()}
