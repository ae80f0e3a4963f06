"""Lightning's model summary counts the whole model under both strategies, and a model with an
``example_input_array`` (which Lightning's summary runs through the model) trains."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import run_ranks
from lightning.pytorch.callbacks import ModelSummary
from models import SEQ, TinyLM, token_dataset
from torch.utils.data import DataLoader

from lightning_varuna import SpillingStrategy


class RecordedSummary(ModelSummary):
    """Lightning's model summary, whose figures are kept in ``seen`` as well as printed."""

    def __init__(self) -> None:
        super().__init__(max_depth=1)
        self.seen: dict[str, Any] = {}

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs) -> None:  # noqa: ANN001
        self.seen = {"total": total_parameters, "trainable": trainable_parameters, "megabytes": model_size}
        super().summarize(summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs)


class WithExampleInput(TinyLM):
    """TinyLM with an example input for the summary (layer sizes) and its first block frozen, as in fine-tuning."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, SEQ, dtype=torch.long)
        self.blocks[0].requires_grad_(False)


def expected_counts(model: torch.nn.Module) -> dict[str, int]:
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def test_a_spilled_model_is_summarized_whole():
    """Spilled parameters hold no elements between their turns: the summary counts them by their shapes all the
    same, and leaves the example input out (the model is not whole on the device)."""
    model = WithExampleInput()
    expected = expected_counts(model)
    summary = RecordedSummary()
    strategy = SpillingStrategy(memory_budget="48KB")  # 5 shards: it needs 64 KB whole at batches of 4
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        callbacks=[summary],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(token_dataset(8), batch_size=4))
    assert len(strategy.shards) > 1
    assert {k: summary.seen[k] for k in expected} == expected
    assert expected["trainable"] < expected["total"]
    assert model.example_input_array is not None
    assert "on_fit_start" not in vars(summary)  # the callback is its own again after the fit


SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import lightning as L
from torch.utils.data import DataLoader
from models import token_dataset
from test_model_summary import RecordedSummary, WithExampleInput
from lightning_varuna import VarunaStrategy

summary = RecordedSummary()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=VarunaStrategy(pipeline_parallel_size=2), max_steps=2,
                    callbacks=[summary], logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(WithExampleInput(), DataLoader(token_dataset(8), batch_size=4))
if trainer.global_rank == 0:
    with open({out!r}, "w") as f:
        json.dump(summary.seen, f)
"""


@pytest.mark.slow
def test_a_pipelined_model_is_summarized_whole(tmp_path):
    """Rank 0 holds the first stage's parameters alone: its summary counts every stage's."""
    out = tmp_path / "summary.json"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent), out=str(out))))
    proc = run_ranks([str(script)], 2, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    expected = expected_counts(WithExampleInput())
    assert {k: seen[k] for k in expected} == expected
