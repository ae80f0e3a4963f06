"""What a pipelined step trains on and logs, against one device: batches augmented from torch's generator, losses
that are means over some of a batch's items, torchmetrics objects, the module's epoch-end hooks and gradient norms
(real multi-process runs)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import run_ranks

pytestmark = pytest.mark.slow  # real multi-process jobs


def run_one_device_and_pipelined(
    tmp_path: Path, template: str, replicas_of_runs: tuple[int, ...] = (0, 1, 2), **fields: str
) -> dict[int, dict[str, tuple[Any, Any]]]:
    """Run ``template`` (with ``fields``) on one device (replicas 0) and on two stages with one and two replicas;
    what each rank printed (``rank R <python literal> <python literal>``) by replicas and rank."""
    runs = {}
    for replicas in replicas_of_runs:
        script = tmp_path / f"run_{replicas}.py"
        script.write_text(template.format(tests=os.path.dirname(__file__), replicas=replicas, **fields))
        proc = run_ranks([str(script)], 2 * replicas or 1, tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[replicas] = {
            rank: (ast.literal_eval(first), ast.literal_eval(second))
            for rank, first, second in re.findall(r"rank (\d) (\[.*\]) ([\[{].*[\]}])", proc.stdout)
        }
    return runs


TOKEN_MEAN = """
import os
import sys
sys.path.insert(0, {tests!r})
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from models import DIM, SEQ, VOCAB, Block
from lightning_varuna import CutPoint, VarunaStrategy


class TokenMean(L.LightningModule):
    \"\"\"A language model whose loss is the mean over the tokens that have a label (-100: none).\"\"\"

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(4))
        self.cut = CutPoint()
        self.head = nn.Linear(DIM, VOCAB)
        self.losses = []

    def forward(self, idx):
        x = self.embedding(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, torch.ones_like(x[..., :1]))
            if i == 1:
                x = self.cut(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


torch.manual_seed(0)
model = TokenMean()
ids = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(1))
labelled = torch.arange(SEQ) < (1 + torch.arange(32) % SEQ).unsqueeze(1)  # 1 to SEQ tokens per row have labels
labels = torch.where(labelled, (ids * 3 + 1) % VOCAB, -100)
data = [{{"input_ids": ids[i], "labels": labels[i]}} for i in range(32)]
replicas = {replicas}
pipelined = replicas > 0
sampler = None if pipelined else DistributedSampler(data, 1, 0, seed=0)
loader = DataLoader(data, batch_size=8 // max(replicas, 1), sampler=sampler)
strategy = "auto"
if pipelined:
    strategy = VarunaStrategy(pipeline_parallel_size=2, data_parallel_size=replicas, micro_batch_size=2,
                              loss_items={loss_items})
trainer = L.Trainer(accelerator="cpu", devices=2 * replicas if pipelined else 1, strategy=strategy, max_epochs=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(model, loader)
weights = {{name: p.detach().flatten()[:8].tolist() for name, p in model.named_parameters()}}
os.write(1, f"rank {{trainer.global_rank}} {{model.losses}} {{weights}}\\n".encode())  # one write: shared stdout
"""


COUNT_LABELLED = 'lambda batch: (batch["labels"] != -100).sum()'


def test_a_mean_over_labelled_tokens_trains_pipelined_as_on_one_device(tmp_path):
    """A loss that is the mean over the tokens that have a label, micro-batches holding different numbers of them:
    with `loss_items` counting them, each micro-batch counts by its tokens (not its rows), and two stages train
    one device's model on the whole batch's mean, with one replica (and log its losses) and with two (each replica
    logs its own half batch's mean, as under DDP)."""
    runs = run_one_device_and_pipelined(tmp_path, TOKEN_MEAN, loss_items=COUNT_LABELLED)
    expected_losses, expected_weights = runs[0]["0"]
    assert runs[1]["1"][0] == pytest.approx(expected_losses, rel=1e-5)
    for replicas, ranks in (1, ["0", "1"]), (2, ["0", "1", "2", "3"]):
        assert sorted(runs[replicas]) == ranks
        stage_weights = [weights for _, weights in runs[replicas].values()]
        assert set().union(*stage_weights) == set(expected_weights)  # every parameter is on some stage
        for weights in stage_weights:
            for name, values in weights.items():
                assert values == pytest.approx(expected_weights[name], rel=1e-5, abs=1e-6), name


AUGMENTED = """
import os
import sys
sys.path.insert(0, {tests!r})
import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from models import VOCAB, TinyLM, token_dataset
from lightning_varuna import VarunaStrategy


class Shifted(Dataset):
    \"\"\"Token rows shifted by a random offset drawn from torch's global generator, as transforms draw them.\"\"\"

    def __init__(self):
        self.rows = token_dataset(32)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        idx, labels = self.rows[i]
        return (idx + torch.randint(0, 3, ())) % VOCAB, labels


class DropsTokens(TinyLM):
    \"\"\"Drops tokens at random as the batch arrives on the device (an augmentation on the GPU, as kornia's).\"\"\"

    def on_after_batch_transfer(self, batch, dataloader_idx):
        idx, labels = batch
        return torch.where(torch.rand(idx.shape) < 0.2, 0, idx), labels

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))


L.seed_everything(0)
model = DropsTokens(lr=0.05)
model.losses = []
pipelined = {replicas} > 0
data = Shifted()
loader = DataLoader(data, batch_size=8, sampler=None if pipelined else DistributedSampler(data, 1, 0, seed=0),
                    num_workers={workers}, persistent_workers={workers} > 0)
strategy = VarunaStrategy(pipeline_parallel_size=2) if pipelined else "auto"
trainer = L.Trainer(accelerator="cpu", devices=2 if pipelined else 1, strategy=strategy, max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader, DataLoader(token_dataset(16, seed=2), batch_size=8))
weights = {{name: p.detach().flatten()[:8].tolist() for name, p in model.named_parameters()}}
os.write(1, f"rank {{trainer.global_rank}} {{model.losses}} {{weights}}\\n".encode())  # one write: shared stdout
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_augmented_from_torch_s_generator_train_pipelined_as_on_one_device(tmp_path, workers):
    """A dataset and an `on_after_batch_transfer` that draw from torch's global generator (in the loader's workers,
    seeded from it) draw what one device draws: set-up draws nothing it does not give back (its look at the first
    batch ran `on_after_batch_transfer`), and the processes' generators are not seeded again (as Lightning's DDP
    does) but stay as the script left them."""
    runs = run_one_device_and_pipelined(tmp_path, AUGMENTED, replicas_of_runs=(0, 1), workers=str(workers))
    expected_losses, expected_weights = runs[0]["0"]
    assert runs[1]["1"][0] == pytest.approx(expected_losses, rel=1e-5)
    for _, weights in runs[1].values():
        for name, values in weights.items():
            assert values == pytest.approx(expected_weights[name], rel=1e-5, abs=1e-6), name


METRICS = """
import copy
import os
import sys
sys.path.insert(0, {tests!r})
import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from models import DIM, VOCAB, Block, token_dataset
from lightning_varuna import CutPoint, VarunaStrategy


class KeepsOutputs(L.LightningModule):
    \"\"\"Logs torchmetrics objects per step and per epoch, and keeps step outputs for its epoch-end hooks, as
    Lightning's docs show.\"\"\"

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(4))
        self.cut = CutPoint()
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embedding.weight  # tied across the stages: its norm counts once in the total
        self.train_f1 = torchmetrics.classification.MulticlassF1Score(VOCAB, average="macro")
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(VOCAB)
        self.f1 = torchmetrics.classification.MulticlassF1Score(VOCAB, average="macro")
        self.auroc = torchmetrics.classification.MulticlassAUROC(VOCAB)  # float and integer list states
        self.train_losses, self.val_losses, self.step_f1 = [], [], []

    def forward(self, idx):
        keep = (idx != 0).unsqueeze(-1).float()
        x = self.embedding(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, keep)
            if i == 1:
                x = self.cut(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        logits = self(batch[0]).flatten(0, 1)
        loss = F.cross_entropy(logits, batch[1].flatten())
        self.train_f1(logits, batch[1].flatten())
        self.log("train_f1", self.train_f1, on_step=True, on_epoch=True)
        self.log("rows", float(len(batch[0])), reduce_fx="sum", sync_dist=True)  # the global batch's
        self.train_losses.append(loss.detach())
        return loss

    def on_train_start(self):
        copy.deepcopy(self)  # as weight averaging of one's own copies the module, its wrapped hooks included

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_f1.append(float(self.trainer.callback_metrics["train_f1_step"]))

    def on_train_epoch_end(self):
        self.log("train_epoch_loss", torch.stack(self.train_losses).mean(), sync_dist=True)
        self.train_losses.clear()

    def validation_step(self, batch, batch_idx):
        logits = self(batch[0]).flatten(0, 1)
        self.val_losses.append(F.cross_entropy(logits, batch[1].flatten()))
        self.accuracy.update(logits, batch[1].flatten())
        self.f1.update(logits, batch[1].flatten())
        self.auroc.update(logits, batch[1].flatten())
        self.log("val_auroc", self.auroc)

    def on_validation_epoch_end(self):
        self.log("val_loss", torch.stack(self.val_losses).mean(), sync_dist=True)
        self.log("val_loss_gathered", self.all_gather(torch.stack(self.val_losses)).mean())
        self.log("val_accuracy", self.accuracy.compute())
        self.log("val_accuracy_whole", self.accuracy)  # computed again at the epoch's end
        self.log("val_f1", self.f1)
        self.log("val_epoch", float(self.trainer.strategy.broadcast(self.current_epoch)))
        self.log("val_global_zero", float(self.trainer.is_global_zero), reduce_fx="sum", sync_dist=True)
        self.val_losses.clear()

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))  # each stage sees its own parameters' gradients
        self.log("head_grad_max", grad_norm(self.head, "inf").get("grad_inf_norm_total", -1.0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
model, data = KeepsOutputs(), token_dataset(32)
replicas = {replicas}
pipelined = replicas > 0
sampler = None if pipelined else DistributedSampler(data, 1, 0, seed=0)
loader = DataLoader(data, batch_size=8 // max(replicas, 1), sampler=sampler)
strategy = VarunaStrategy(pipeline_parallel_size=2, data_parallel_size=replicas) if pipelined else "auto"
trainer = L.Trainer(accelerator="cpu", devices=2 * replicas if pipelined else 1, strategy=strategy, max_epochs=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(model, loader, DataLoader(data, batch_size=8 // max(replicas, 1)))
metrics = sorted((name, float(value)) for name, value in trainer.callback_metrics.items() if name != "train_f1")
os.write(1, f"rank {{trainer.global_rank}} {{metrics}} {{model.step_f1}}\\n".encode())  # one write: shared stdout
"""


def test_torchmetrics_epoch_ends_and_gradient_norms_log_what_one_device_logs(tmp_path):
    """torchmetrics objects logged per step (F1: the batch's, not a mean of its micro-batches') and for the epoch
    (AUROC, whose states are float scores and integer targets), step outputs kept in a list for the epoch-end hooks,
    a metric computed by hand there (and logged whole), `self.all_gather`, `sync_dist` means and sums, a broadcast
    and `is_global_zero` there, and Lightning's `grad_norm` in `on_before_optimizer_step`: two stages, with one
    replica and with two, log one device's values on every rank (the steps' state is on the last stages: the
    epoch-end hooks run there and send what they log; each stage logs its own gradients' norms, merged). Per step,
    two replicas log each its own half batch's F1, as under DDP."""
    runs = run_one_device_and_pipelined(tmp_path, METRICS)
    (expected, expected_steps) = runs[0]["0"]
    assert {
        *("train_epoch_loss", "train_f1_epoch", "train_f1_step", "val_accuracy", "val_auroc", "val_f1", "val_loss"),
        *("val_loss_gathered", "grad_2.0_norm_total", "grad_2.0_norm/embedding.weight", "head_grad_max"),
        *("rows", "val_accuracy_whole", "val_epoch", "val_global_zero"),
    } <= {name for name, _ in expected}
    for replicas, ranks in (1, ["0", "1"]), (2, ["0", "1", "2", "3"]):
        assert sorted(runs[replicas]) == ranks
        for metrics, steps in runs[replicas].values():
            for (name, value), (expected_name, expected_value) in zip(metrics, expected, strict=True):
                assert name == expected_name, name
                if replicas == 1 or name != "train_f1_step":
                    assert value == pytest.approx(expected_value, rel=1e-5), name
            if replicas == 1:
                assert steps == pytest.approx(expected_steps, rel=1e-5)


def test_labels_without_a_label_and_no_loss_items_are_warned_of(tmp_path):
    """Hugging Face's -100 in a batch's labels, micro-batches counted by rows: the log says to pass `loss_items`."""
    script = tmp_path / "rows.py"
    script.write_text(TOKEN_MEAN.format(tests=os.path.dirname(__file__), replicas=1, loss_items=None))
    proc = run_ranks([str(script)], 2, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert 'pass `VarunaStrategy(loss_items=lambda batch: (batch["labels"] != -100).sum())`' in proc.stderr


TWO_VALIDATION_LOADERS = """
import os
import sys
sys.path.insert(0, {tests!r})
import lightning as L
from torch.utils.data import DataLoader, DistributedSampler
from models import TinyLM, token_dataset
from lightning_varuna import VarunaStrategy


class TwoLoaders(TinyLM):
    \"\"\"Logs its one F1 metric object from two validation loaders: Lightning computes it at the end of each.\"\"\"

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        super().validation_step(batch, batch_idx)


L.seed_everything(0)
model, data = TwoLoaders(), token_dataset(16)
replicas = {replicas}
pipelined = replicas > 0
sampler = None if pipelined else DistributedSampler(data, 1, 0, seed=0)
batch_size = 4 // max(replicas, 1)
strategy = VarunaStrategy(pipeline_parallel_size=2, data_parallel_size=replicas) if pipelined else "auto"
trainer = L.Trainer(accelerator="cpu", devices=2 * replicas if pipelined else 1, strategy=strategy, max_epochs=2,
                    num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
validation = [DataLoader(token_dataset(8, seed=seed), batch_size=batch_size) for seed in (2, 3)]
trainer.fit(model, DataLoader(data, batch_size=batch_size, sampler=sampler), validation)
metrics = sorted((name, float(value)) for name, value in trainer.callback_metrics.items() if name.startswith("val"))
os.write(1, f"rank {{trainer.global_rank}} {{metrics}} []\\n".encode())  # one write: shared stdout
"""


def test_one_metric_logged_from_two_validation_loaders_logs_what_one_device_logs(tmp_path):
    """Lightning computes a metric object at the end of each validation loader: the stages that never update it
    compute it again with the last stage after the second loader (they kept the first loader's value, which made
    the last stage wait for them, and the job hung)."""
    runs = run_one_device_and_pipelined(tmp_path, TWO_VALIDATION_LOADERS)
    (expected, _) = runs[0]["0"]
    assert {name for name, _ in expected} == {f"val_{m}/dataloader_idx_{i}" for m in ("f1", "loss") for i in (0, 1)}
    for replicas in (1, 2):
        assert len(runs[replicas]) == 2 * replicas
        for metrics, _ in runs[replicas].values():
            assert [name for name, _ in metrics] == [name for name, _ in expected]
            assert [value for _, value in metrics] == pytest.approx([value for _, value in expected], rel=1e-5)
