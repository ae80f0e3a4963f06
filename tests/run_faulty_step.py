"""Train `TinyLM` on 2 pipeline stages (``Trainer(devices=2)``) with a fault in ``training_step`` on batch 1.

    python tests/run_faulty_step.py FAULT RANKS [MARKER]

``FAULT`` happens on the global ranks in ``RANKS`` (comma-separated): ``twice`` calls ``self(...)`` twice, ``skip``
returns a loss without calling it, ``die`` SIGKILLs the process, ``stall`` creates the file ``MARKER`` and waits in
the step, before its forward, until the process received SIGTERM (a slow stage, while the other waits for it),
``slow`` does as ``stall`` and then takes 1 s more before each forward (the other stage gives up waiting meanwhile),
``unpicklable`` returns a function beside the loss.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from models import TinyLM, token_dataset  # noqa: E402

from lightning_varuna import VarunaStrategy  # noqa: E402


class FaultyLM(TinyLM):
    def __init__(self, fault: str, ranks: set[int], marker: str | None) -> None:
        super().__init__(blocks=2)
        self.fault, self.ranks, self.marker = fault, ranks, marker

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        idx, y = batch
        faulty = batch_idx == 1 and self.global_rank in self.ranks
        if faulty and self.fault == "skip":
            return self.head.weight.sum() * 0
        if faulty and self.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and self.fault in ("stall", "slow"):
            Path(self.marker).touch()
            while not self.trainer.received_sigterm:
                time.sleep(0.05)
            if self.fault == "slow":
                time.sleep(1)
        logits = self(idx)
        if faulty and self.fault == "twice":
            logits = logits + self(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return {"loss": loss, "describe": lambda: "a function"} if faulty and self.fault == "unpicklable" else loss


def main(fault: str, ranks: str, marker: str | None = None) -> None:
    model = FaultyLM(fault, {int(r) for r in ranks.split(",")}, marker)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=VarunaStrategy(pipeline_parallel_size=2, micro_batch_size=2),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(token_dataset(16), batch_size=4))


if __name__ == "__main__":
    main(*sys.argv[1:])
