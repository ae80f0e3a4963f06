"""The GPT example driven by the Lightning CLI, configured from YAML:

    python examples/gpt_cli.py fit --config examples/gpt_cli.yaml
    python examples/gpt_cli.py fit --config examples/gpt_cli.yaml --trainer.strategy.pipeline_parallel_size=4
    python examples/gpt_cli.py fit --config examples/gpt_cli.yaml --trainer.strategy=varuna   # registry name, defaults

On the command line, `--trainer.strategy=VarunaStrategy --trainer.strategy.pipeline_parallel_size=2` selects the
class by name and sets its arguments (a registry name such as `varuna` takes no nested arguments in jsonargparse).
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from gpt import GPT, CharDataset, make_text  # noqa: E402

import lightning_varuna  # noqa: E402, F401  (registers the "varuna" strategy)


class TextDataModule(L.LightningDataModule):
    """Character windows of the generated corpus, split 90/10 into train and validation."""

    def __init__(self, block_size: int = 32, batch_size: int = 8) -> None:
        super().__init__()
        self.data = CharDataset(make_text(), block_size)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        split = int(0.9 * len(self.data))
        return DataLoader(torch.utils.data.Subset(self.data, range(split)), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        split = int(0.9 * len(self.data))
        return DataLoader(torch.utils.data.Subset(self.data, range(split, len(self.data))), batch_size=self.batch_size)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
        parser.link_arguments(
            "data.data", "model.vocab_size", compute_fn=lambda d: len(d.vocab), apply_on="instantiate"
        )


if __name__ == "__main__":
    GPTCLI(GPT, TextDataModule, seed_everything_default=0, save_config_kwargs={"overwrite": True})
