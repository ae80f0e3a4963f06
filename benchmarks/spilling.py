"""Step time of SpillingStrategy against in-memory training, side by side, and against the disk's floor.

Run from the repository root (about 3 minutes on 2 CPU cores)::

    python benchmarks/spilling.py

The model is an MLP of ``--layers`` Linear(``--width``, ``--width``) layers with a CutPoint after each, trained with
AdamW on batches of ``--batch`` rows, one thread per process. Each variant runs in a fresh process:

* ``in-memory``: ``Trainer(devices=1)`` with Lightning's default strategy (the model fits in memory here);
* ``spill-host``: ``SpillingStrategy(spill_dir=None)``: on the CPU host memory is the device's, so nothing moves:
  this is the strategy's compute (recomputed forwards included) without transfers;
* ``spill-disk``: ``SpillingStrategy(spill_dir=...)`` with the budget of one layer per shard: every step reads and
  writes every shard's parameters, gradients and AdamW state through the disk (files written through and dropped
  from the page cache, so reads come from the disk), the next shard read while the current one computes;
* ``spill-disk-no-prefetch``: the same, each shard read only when it is needed;
* ``spill-disk-clipped``: the same as spill-disk with ``gradient_clip_val=1.0``: clipping by the norm over all shards
  needs every shard's gradients first, so the optimizer steps in a pass of its own after backward (the other
  variants step each shard right after its backward).

The disk's bandwidth is measured first, in the spill store's own pattern (32 files of a shard's parameters and
gradients, each rewritten in place with ``fdatasync`` and dropped from the page cache, then read back). The floor
of a disk step is max(compute, bytes read / read bandwidth + bytes written / write bandwidth), compute being the
spill-host step. Step time is the median over the timed steps after the warm-up; the optimizer's share is the
time of the shard-by-shard optimizer step (it runs on the device, here the CPU, one shard at a time with its state
read from the disk).

Writes ``benchmarks/results/spilling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import CutPoint, SpillingStrategy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "spilling.json"
VARIANTS = ["in-memory", "spill-host", "spill-disk", "spill-disk-no-prefetch", "spill-disk-clipped"]


class MLP(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(layers - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.step_s: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.step_s.append(time.perf_counter() - self._start)


def layer_state_bytes(width: int) -> int:
    """A layer's parameters, gradients and AdamW's two moments."""
    return 4 * (width * width + width) * 4


def worker(variant: str, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(args.width, args.layers)
    rows = args.batch * (args.warmup + args.steps)
    data = TensorDataset(torch.randn(rows, args.width), torch.randn(rows, args.width))
    budget = 3 * layer_state_bytes(args.width)  # one layer per shard, the next arriving, boundaries beside
    if variant == "spill-disk-no-prefetch":
        budget //= 2  # without a shard arriving the budget would allow two layers per shard: keep the same shards
    strategy: Any = "auto"
    optimizer_s: list[float] = []
    if variant != "in-memory":
        spill_dir = tempfile.mkdtemp(dir=args.spill_dir) if variant.startswith("spill-disk") else None
        strategy = SpillingStrategy(
            memory_budget=budget, spill_dir=spill_dir, prefetch=variant != "spill-disk-no-prefetch"
        )
        step_shards = strategy._step_shards

        def timed_step(optimizer: Any) -> None:
            start = time.perf_counter()
            step_shards(optimizer)
            optimizer_s.append(time.perf_counter() - start)

        strategy._step_shards = timed_step
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        gradient_clip_val=1.0 if variant == "spill-disk-clipped" else None,
    )
    moved: dict[str, int] = {}
    if variant != "in-memory":

        class Bytes(L.Callback):
            def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
                store = strategy._sharded.store
                if trainer.global_step == args.warmup:
                    moved.update(read=store.bytes_read, written=store.bytes_written)
                if trainer.global_step == args.warmup + args.steps:
                    moved.update(read=store.bytes_read - moved["read"], written=store.bytes_written - moved["written"])

        trainer.callbacks.append(Bytes())
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    state = sum(4 * p.numel() * p.element_size() for p in model.parameters())
    result = {
        "variant": variant,
        "step_s": statistics.median(timer.step_s[args.warmup :]),
        "optimizer_s": statistics.median(optimizer_s[args.warmup :]) if optimizer_s else None,
        "optimizer_in_backward": getattr(strategy, "optimizer_in_backward", None),
        "shards": len(strategy.shards) if variant != "in-memory" else None,
        "state_bytes": state,
        "budget_bytes": budget if variant != "in-memory" else None,
        "read_bytes_per_step": moved.get("read", 0) / args.steps,
        "written_bytes_per_step": moved.get("written", 0) / args.steps,
    }
    out.write_text(json.dumps(result))


def disk_bandwidth(folder: str, file_bytes: int, files: int = 32) -> tuple[float, float]:
    """(read, write) bytes per second of ``folder``'s disk, in the spill store's pattern: ``files`` files of
    ``file_bytes`` each rewritten in place through (``fdatasync``) and dropped from the page cache, then read back
    into one buffer."""
    block = os.urandom(file_bytes)
    where = Path(tempfile.mkdtemp(dir=folder))
    for _ in range(2):  # the first pass creates the files; the second, timed, rewrites them in place
        start = time.perf_counter()
        for i in range(files):
            with open(os.open(where / f"{i}.bin", os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(block)
                f.flush()
                os.fdatasync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    write = files * file_bytes / (time.perf_counter() - start)
    buffer = bytearray(file_bytes)
    start = time.perf_counter()
    for i in range(files):
        with open(where / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(buffer)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    read = files * file_bytes / (time.perf_counter() - start)
    for i in range(files):
        (where / f"{i}.bin").unlink()
    where.rmdir()
    return read, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--spill-dir", default=tempfile.gettempdir(), help="folder on the disk to measure")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args, Path(args.out))
        return

    read_bw, write_bw = disk_bandwidth(args.spill_dir, layer_state_bytes(args.width) // 2)
    print(
        f"torch {torch.__version__}, lightning {L.__version__}, {os.cpu_count()} CPUs, 1 thread; MLP {args.layers} x "
        f"Linear({args.width}, {args.width}), AdamW, batch {args.batch}; disk at {args.spill_dir}: read "
        f"{read_bw / 2**20:.0f} MiB/s, write {write_bw / 2**20:.0f} MiB/s",
        flush=True,
    )
    rows = []
    for variant in VARIANTS:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--worker", variant, "--out", out.name]
            command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "out")]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True)
            row = json.loads(Path(out.name).read_text())
        rows.append(row)
        print(f"  {variant:<24} {1000 * row['step_s']:8.1f} ms/step", flush=True)

    by_name = {row["variant"]: row for row in rows}
    compute = by_name["spill-host"]["step_s"]
    for row in rows:
        row["vs_in_memory"] = row["step_s"] / by_name["in-memory"]["step_s"]
        io = row["read_bytes_per_step"] / read_bw + row["written_bytes_per_step"] / write_bw
        row["floor_s"] = max(compute, io) if row["variant"].startswith("spill-disk") else None
        row["vs_floor"] = row["step_s"] / row["floor_s"] if row["floor_s"] else None
    print()
    print("| variant | step ms | vs in-memory | MiB read + written per step | floor ms | vs floor | optimizer ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        moved = (r["read_bytes_per_step"] + r["written_bytes_per_step"]) / 2**20
        floor = f"{1000 * r['floor_s']:.0f}" if r["floor_s"] else "-"
        vs_floor = f"{r['vs_floor']:.2f}x" if r["vs_floor"] else "-"
        optimizer = f"{1000 * r['optimizer_s']:.0f}" if r["optimizer_s"] else "-"
        print(
            f"| {r['variant']} | {1000 * r['step_s']:.0f} | {r['vs_in_memory']:.2f}x | {moved:.0f} | {floor} "
            f"| {vs_floor} | {optimizer} |"
        )
    spilled = by_name["spill-disk"]
    print(
        f"\nmodel state (parameters, gradients, AdamW) {spilled['state_bytes'] / 2**20:.0f} MiB, budget "
        f"{spilled['budget_bytes'] / 2**20:.1f} MiB: {spilled['state_bytes'] / spilled['budget_bytes']:.1f}x, in "
        f"{spilled['shards']} shards; prefetch: {by_name['spill-disk-no-prefetch']['step_s'] / spilled['step_s']:.2f}x "
        "faster than without"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    header = {"torch": torch.__version__, "lightning": L.__version__, "python": platform.python_version()}
    RESULTS.write_text(
        json.dumps(
            {**header, "args": vars(args), "disk_read_Bps": read_bw, "disk_write_Bps": write_bw, "results": rows},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
