"""Small models and data shared by the tests and the multi-process runner script."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from lightning_varuna import CutPoint, VarunaStrategy

VOCAB, SEQ, DIM = 11, 6, 16


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.norm(x)))) * keep


class TinyLM(L.LightningModule):
    """Token model with 4 CutPoints (5 segments), a head tied to the embedding and a mask that every block
    reads (a value that crosses several stages besides the activation)."""

    def __init__(
        self, blocks: int = 5, lr: float = 0.05, scheduler: bool = False, dropout: float = 0.0, dim: int = DIM
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(blocks))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(blocks - 1))
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro")
        # Not a mean over rows: its epoch value is computed from all batches' counts (pipelined: gathered).
        self.val_f1 = torchmetrics.classification.MulticlassF1Score(VOCAB, average="macro")
        self.lr, self.scheduler = lr, scheduler

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.through_blocks(self.emb(idx), idx))

    def through_blocks(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``x`` through the blocks, a CutPoint after each but the last, masking the padding of ``idx``."""
        keep = (idx != 0).unsqueeze(-1).float()
        for i, block in enumerate(self.blocks):
            x = block(x, keep)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.acc(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", self.acc, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, y = batch
        logits = self(idx).flatten(0, 1)
        self.log("val_loss", F.cross_entropy(logits, y.flatten()), sync_dist=True)
        self.val_f1(logits, y.flatten())
        self.log("val_f1", self.val_f1)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


class CountingLM(TinyLM):
    """TinyLM whose forward reads a buffer it changes: the count of its calls, which divides the embeddings. A
    forward recomputed for backward must read the count as the first run found it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.head(self.through_blocks(self.emb(idx) / self.calls, idx))


class StopsItselfLM(TinyLM):
    """Sets ``trainer.should_stop`` in its training step (after its forward, as a stop decided on the loss does) in
    the step that makes ``stop_at_step`` optimizer steps."""

    stop_at_step = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step + 1 >= self.stop_at_step:
            self.trainer.should_stop = True
        return loss


class SetsLearningRateAtEpochEndLM(TinyLM):
    """Halves its learning rate by hand at each epoch's end and steps its scheduler (if any) once more there: a hook
    that runs on the last stage alone when pipelined."""

    def on_train_epoch_end(self) -> None:
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] *= 0.5
        if self.scheduler:
            self.lr_schedulers().step()


def model_for(config: dict) -> TinyLM:
    """The TinyLM a runner config describes (``scheduler``, ``dropout``, ``dim``, ``blocks``, ``counting``: a
    `CountingLM`; ``stop_at_step``: a `StopsItselfLM`; ``lr_at_epoch_end``: a `SetsLearningRateAtEpochEndLM`;
    ``frozen``: the names of submodules to freeze)."""
    model_class = (
        CountingLM if config.get("counting")
        else StopsItselfLM if "stop_at_step" in config
        else SetsLearningRateAtEpochEndLM if config.get("lr_at_epoch_end")
        else TinyLM
    )  # fmt: skip
    options = {"blocks": config["blocks"]} if "blocks" in config else {}
    model = model_class(
        scheduler=config.get("scheduler", False),
        dropout=config.get("dropout", 0.0),
        dim=config.get("dim", DIM),
        **options,
    )
    for name in config.get("frozen", ()):
        model.get_submodule(name).requires_grad_(False)
    if "stop_at_step" in config:
        model.stop_at_step = config["stop_at_step"]
    return model


def token_dataset(rows: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return TensorDataset(idx, (idx * 3 + 1) % VOCAB)


class RecordLosses(L.Callback):
    """The logged ``train_loss`` of every step, and the fp16 loss scale after it (if a grad scaler runs)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.loss_scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(trainer.callback_metrics["train_loss"].item())
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.loss_scales.append(scaler.get_scale())


def fit_and_report(
    model: TinyLM,
    train_loader: torch.utils.data.DataLoader,
    config: dict,
    predict: bool,
    callbacks: list[L.Callback] = (),
    ckpt_path: str | None = None,
    **trainer_kwargs,
) -> tuple[L.Trainer, dict]:
    """Fit with the test settings of ``config`` (resuming from ``ckpt_path``); return the trainer and what the
    parity tests compare."""
    record = RecordLosses()
    precision = config.get("precision", "32-true")
    if "fp16_init_scale" in config:  # fp16 with loss scaling as on CUDA (Lightning itself offers bf16 on CPU)
        device = "cuda" if config.get("accelerator") == "gpu" else "cpu"
        scaler = torch.amp.GradScaler(device, init_scale=config["fp16_init_scale"])
        trainer_kwargs["plugins"], precision = [MixedPrecision("16-mixed", device, scaler)], None
    trainer = L.Trainer(
        accelerator=config.get("accelerator", "cpu"),
        max_epochs=config["epochs"],
        max_steps=config.get("max_steps", -1),
        gradient_clip_val=config.get("clip"),
        accumulate_grad_batches=config.get("accumulate", 1),
        precision=precision,
        callbacks=[record, *callbacks],
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    val_loader = None
    if config.get("validate_during_fit"):  # validation at every epoch end, as most training scripts do
        val_loader = torch.utils.data.DataLoader(token_dataset(config["rows"], seed=2), batch_size=config["batch_size"])
    trainer.fit(model, train_loader, val_loader, ckpt_path=ckpt_path)
    result = {"losses": record.losses, "acc": trainer.callback_metrics["train_acc"].item()}
    if record.loss_scales:
        result["loss_scales"] = record.loss_scales
    if config.get("evaluate"):
        loader = torch.utils.data.DataLoader(token_dataset(config["rows"], seed=2), batch_size=config["batch_size"])
        validated = trainer.validate(model, loader, verbose=False)[0]
        result["val_loss"], result["val_f1"] = validated["val_loss"], validated["val_f1"]
        if predict:
            result["predictions"] = torch.cat(trainer.predict(model, loader)).tolist()
    return trainer, result


class NormalizesOverRows(TinyLM):
    """Each row's mean embedding through a BatchNorm1d: one value per channel in a one-row micro-batch."""

    def __init__(self) -> None:
        super().__init__(blocks=2)
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        keep = (idx != 0).unsqueeze(-1).float()
        x = self.blocks[1](self.cuts[0](self.blocks[0](self.emb(idx), keep)), keep)
        return self.head(x + self.norm(x.mean(1)).unsqueeze(1))


def one_device_or_two_stages(
    pipelined: bool, data: Dataset, batch_size: int, **options: Any
) -> tuple[L.Trainer, DataLoader]:
    """A Trainer on one device, or on two pipeline stages (in two processes), and a loader that reads the rows in
    the same order on both (VarunaStrategy's sampler: one replica's `DistributedSampler`)."""
    sampler = None if pipelined else DistributedSampler(data, 1, 0, seed=0)  # type: ignore[arg-type]
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    strategy = VarunaStrategy(pipeline_parallel_size=2) if pipelined else "auto"
    options = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, **options}
    trainer = L.Trainer(accelerator="cpu", devices=2 if pipelined else 1, strategy=strategy, **options)
    return trainer, loader
