"""A small GPT language model trained with VarunaStrategy on a text this script generates.

    python examples/gpt.py

runs 2 pipeline stages x 2 data-parallel replicas on 4 CPU processes (gloo) for 60 steps; on GPUs pass
``--accelerator gpu``. It checkpoints to ``checkpoints/gpt`` (``--checkpoint-dir DIR``: another folder or fsspec
URL; ``--checkpoint-dir ''``: none) and, run again (with any ``--devices`` / ``--pipeline-parallel-size`` and
``--batch-size`` x replicas kept), resumes where it stopped: a larger ``--max-steps`` trains on.
The LM head is tied to the token embedding, so the first and last stages share it.

Elastic: under ``torchrun`` the process count comes from torchrun; with ``--global-batch-size`` and
``--checkpoint-dir``, SIGUSR1 (or SIGTERM) checkpoints and stops the job with exit code 0, and the same command
at another size resumes it with the same training (see the README's "Morphing").

Auto-configured: profile the model once, then let the strategy pick stages and micro-batches for the devices::

    lightning-varuna profile examples/gpt.py:GPT --init-args '{"vocab_size": 25}' --input-shape 8x32 \
        --input-dtype int64 --devices 4 --output gpt.profile.json
    python examples/gpt.py --devices 4 --pipeline-parallel-size auto --micro-batch-size auto \
        --global-batch-size 16 --profile gpt.profile.json --trace step5.json
"""

from __future__ import annotations

import argparse
import math
import signal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_varuna import CutPoint, MorphCallback, PipelineTrace, VarunaStrategy


def make_text(num_sentences: int = 2000, seed: int = 0) -> str:
    """A deterministic toy corpus with learnable structure (subject-verb-object sentences)."""
    g = torch.Generator().manual_seed(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
    verbs = ["sees", "likes", "follows", "draws", "finds", "greets"]
    objects = ["the river", "a red ball", "the moon", "an apple", "the garden", "a quiet house"]
    words = [subjects, verbs, objects]
    sentences = [
        " ".join(w[torch.randint(len(w), (1,), generator=g).item()] for w in words) for _ in range(num_sentences)
    ]
    return ". ".join(sentences) + "."


class CharDataset(Dataset):
    """Fixed-length character windows of a text; the target is the window shifted by one."""

    def __init__(self, text: str, block_size: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        n = (len(ids) - 1) // block_size
        self.x = ids[: n * block_size].view(n, block_size)
        self.y = ids[1 : n * block_size + 1].view(n, block_size)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """A decoder-only transformer with a CutPoint after every block and the head tied to the embedding."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 32,
        dim: int = 64,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, block_size, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, block_size, dropout) for _ in range(layers))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for block, cut in zip(self.blocks, self.cuts):
            x = cut(block(x))
        return self.head(self.ln(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, y = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, y = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), y.flatten())
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", math.e ** loss.item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def int_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument(
        "--pipeline-parallel-size", type=int_or_auto, default=2, help='stages, or "auto" (needs --profile)'
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int_or_auto,
        default=None,
        help='default: 4 micro-batches per stage (the strategy\'s default); or "auto" (needs --profile)',
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        help='1f1b, gpipe, varuna, zero-bubble, interleaved-1f1b (with --stages-per-rank), or "auto" (needs --profile)',
    )
    parser.add_argument(
        "--stages-per-rank", type=int, help="stages per rank of interleaved-1f1b (default 2; needs that many CutPoints)"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--global-batch-size",
        type=int,
        help="rows per step over all replicas, at any world size (the DataLoader is re-batched to it)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--profile", help="a `lightning-varuna profile` of this model: cut with it; needed by auto")
    parser.add_argument("--trace", help="write the measured timeline of step 5 here (Chrome / Perfetto trace)")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument(
        "--checkpoint-dir",
        default="checkpoints/gpt",
        help="folder or fsspec URL: save every 20 steps (and last) there, and resume from the newest complete "
        "checkpoint in it, written with any pipeline shape; SIGUSR1 or SIGTERM save to DIR/morph and stop "
        "(default: %(default)s; '' for none)",
    )
    args = parser.parse_args()

    L.seed_everything(0)
    text = make_text()
    data = CharDataset(text, block_size=32)
    split = int(0.9 * len(data))
    train, val = torch.utils.data.Subset(data, range(split)), torch.utils.data.Subset(data, range(split, len(data)))
    model = GPT(len(data.vocab), layers=args.layers)
    callbacks: list[L.Callback] = [PipelineTrace(args.trace, step=5)] if args.trace else []
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(args.checkpoint_dir, every_n_train_steps=20, save_last=True))
        callbacks.append(MorphCallback(f"{args.checkpoint_dir}/morph", signal=(signal.SIGUSR1, signal.SIGTERM)))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=VarunaStrategy(
            pipeline_parallel_size=args.pipeline_parallel_size,
            micro_batch_size=args.micro_batch_size,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
            global_batch_size=args.global_batch_size,
            profile=args.profile,
        ),
        max_steps=args.max_steps,
        val_check_interval=args.max_steps // 2,
        check_val_every_n_epoch=None,  # validate every val_check_interval steps, across epochs
        limit_val_batches=4,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_dir),
        logger=False,
    )
    loaders = DataLoader(train, batch_size=args.batch_size), DataLoader(val, batch_size=args.batch_size)
    trainer.fit(model, *loaders, ckpt_path="last" if args.checkpoint_dir else None)
    if trainer.is_global_zero and trainer.callback_metrics:
        print(f"final metrics: { {k: round(v.item(), 4) for k, v in trainer.callback_metrics.items()} }")
    elif trainer.is_global_zero:
        print(f"{args.checkpoint_dir} holds a run at --max-steps {args.max_steps} already: a larger one trains on")


if __name__ == "__main__":
    main()
