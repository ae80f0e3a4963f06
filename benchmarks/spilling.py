"""Step time of SpillingStrategy against in-memory training, side by side, and against the disk's floor; and the
largest model this benchmark trains at a 1 GB budget.

Run from the repository root (about 5 minutes on 2 CPU cores, 20 GB free on the disk of ``--spill-dir``)::

    python benchmarks/spilling.py

The model is `lightning_varuna.demos.MLP`: ``--layers`` Linear(``--width``, ``--width``) layers with a CutPoint after
each, trained with AdamW on batches of ``--batch`` rows, one thread per process. Each variant runs in a fresh process:

* ``in-memory``: ``Trainer(devices=1)`` with Lightning's default strategy (the model fits in memory here);
* ``spill-host``: ``SpillingStrategy(spill_dir=None)`` with the budget of one layer per shard, the next arriving and
  room to keep every shard's activations for its backward: on the CPU host memory is the device's, so nothing moves:
  this is the strategy's own cost without transfers;
* ``spill-host-recompute``: the same at the smallest budget that still fetches every shard ahead (the one a refusal
  names): no room for the activations, so every shard but the last computes its forward again in backward;
* ``spill-disk``: ``SpillingStrategy(spill_dir=...)`` at spill-host's budget: every step reads and writes every
  shard's parameters, gradients and AdamW state through the disk (files written through and dropped from the page
  cache, so reads come from the disk), the next shard read while the current one computes;
* ``spill-disk-no-prefetch``: the same, each shard read only when it is needed;
* ``spill-disk-clipped``: the same as spill-disk with ``gradient_clip_val=1.0``: clipping by the norm over all shards
  needs every shard's gradients first, so the optimizer steps in a pass of its own after backward (the other
  variants step each shard right after its backward);
* ``largest-1GB``: an MLP of ``--largest-layers`` Linear(``--largest-width``, ...) layers built in
  ``configure_model`` (never whole in memory), on the disk tier at ``memory_budget="1GB"``, batches of 8.

The disk's bandwidth is measured first, in the spill store's own pattern (32 files of a shard's parameters and
gradients, each rewritten in place with ``fdatasync`` and dropped from the page cache, then read back). The floor
of a disk step is max(compute, bytes read / read bandwidth + bytes written / write bandwidth), compute being the
spill-host step. Step time is the median over the timed steps after the warm-up; the optimizer's share is the
time of the shard-by-shard optimizer step (it runs on the device, here the CPU, one shard at a time with its state
read from the disk). Each variant also reports its whole ``fit`` (set-up and end included) and the growth of the
process's anonymous memory over it (``RssAnon``, sampled every 10 ms and at the end).

Writes ``benchmarks/results/spilling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import SpillingStrategy
from lightning_varuna.demos import MLP
from lightning_varuna.spilling.shards import ShardedModel

LR = 1e-4  # AdamW's
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "spilling.json"
VARIANTS = [
    "in-memory",
    "spill-host",
    "spill-host-recompute",
    "spill-disk",
    "spill-disk-no-prefetch",
    "spill-disk-clipped",
    "largest-1GB",
]


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


class AnonymousMemory:
    """The growth of this process's anonymous memory (`RssAnon`) from entering the block to its peak, sampled."""

    def __enter__(self) -> AnonymousMemory:
        self.start = _rss_anon()
        self._samples = [self.start]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self._samples.append(_rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.growth = max([*self._samples, _rss_anon()]) - self.start


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def refused_budgets(args: argparse.Namespace) -> tuple[int, int]:
    """The smallest budget that trains the model and the smallest that fetches every shard ahead, as a refusal
    names them."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=SpillingStrategy(memory_budget=1), max_steps=1, logger=False
    )
    data = TensorDataset(torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))
    try:
        trainer.fit(MLP(args.width, args.layers, lr=LR), DataLoader(data, batch_size=args.batch))
    except ValueError as refusal:
        _, smallest, prefetching = map(int, re.findall(r"`memory_budget=(\d+)`", str(refusal)))
        return smallest, prefetching
    raise AssertionError("a budget of 1 byte trained")


def worker(variant: str, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    largest = variant == "largest-1GB"
    width, batch = (args.largest_width, 8) if largest else (args.width, args.batch)
    model = (
        MLP(width, args.largest_layers, lr=LR, build_in_configure_model=True)
        if largest
        else MLP(args.width, args.layers, lr=LR)
    )
    warmup, steps = (1, 2) if largest else (args.warmup, args.steps)
    rows = batch * (warmup + steps)
    data = TensorDataset(torch.randn(rows, width), torch.randn(rows, width))
    budget: int | str = 3 * layer_state_bytes(args.width)  # one layer per shard, the next arriving, boundaries beside
    if variant == "spill-disk-no-prefetch":
        budget //= 2  # without a shard arriving the budget would allow two layers per shard: keep the same shards
    if variant == "spill-host-recompute":
        budget = refused_budgets(argparse.Namespace(**{**vars(args), "batch": batch}))[1]
    if largest:
        budget = "1GB"
    strategy: Any = "auto"
    optimizer_s: list[float] = []
    if variant != "in-memory":
        on_disk = variant.startswith("spill-disk") or largest
        spill_dir = tempfile.mkdtemp(dir=args.spill_dir) if on_disk else None
        strategy = SpillingStrategy(
            memory_budget=budget, spill_dir=spill_dir, prefetch=variant != "spill-disk-no-prefetch"
        )
        step_shards = ShardedModel.step  # the optimizer's pass over the shards, after backward

        def timed_step(model: ShardedModel, *args: Any) -> None:
            start = time.perf_counter()
            step_shards(model, *args)
            optimizer_s.append(time.perf_counter() - start)

        ShardedModel.step = timed_step  # type: ignore[method-assign]  # this process runs one variant
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=warmup + steps,
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
                if trainer.global_step == warmup:
                    moved.update(read=store.bytes_read, written=store.bytes_written)
                if trainer.global_step == warmup + steps:
                    moved.update(read=store.bytes_read - moved["read"], written=store.bytes_written - moved["written"])

        trainer.callbacks.append(Bytes())
    start = time.perf_counter()
    with AnonymousMemory() as memory:
        trainer.fit(model, DataLoader(data, batch_size=batch))
    fit_s = time.perf_counter() - start
    state = sum(4 * p.numel() * p.element_size() for p in model.parameters())
    result = {
        "variant": variant,
        "step_s": statistics.median(timer.step_s[warmup:]),
        "fit_s": fit_s,
        "anonymous_growth_bytes": memory.growth,
        "optimizer_s": statistics.median(optimizer_s[warmup:]) if optimizer_s else None,
        "optimizer_in_backward": getattr(strategy, "optimizer_in_backward", None),
        "shards": len(strategy.shards) if variant != "in-memory" else None,
        "recomputing_shards": len(strategy.recomputing_shards) if variant != "in-memory" else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "state_bytes": state,
        "budget_bytes": strategy.budget_bytes if variant != "in-memory" else None,
        "read_bytes_per_step": moved.get("read", 0) / steps,
        "written_bytes_per_step": moved.get("written", 0) / steps,
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
    parser.add_argument("--largest-width", type=int, default=4096)
    parser.add_argument("--largest-layers", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
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
    for variant in args.variants:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--worker", variant, "--out", out.name]
            forwarded = {k: v for k, v in vars(args).items() if k not in ("worker", "out", "variants")}
            command += [f"--{k.replace('_', '-')}={v}" for k, v in forwarded.items()]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True)
            row = json.loads(Path(out.name).read_text())
        rows.append(row)
        print(f"  {variant:<24} {1000 * row['step_s']:8.1f} ms/step", flush=True)

    by_name = {row["variant"]: row for row in rows}
    compute = by_name["spill-host"]["step_s"] if "spill-host" in by_name else None
    for row in rows:
        same_model = row["variant"] != "largest-1GB" and "in-memory" in by_name
        row["vs_in_memory"] = row["step_s"] / by_name["in-memory"]["step_s"] if same_model else None
        io = row["read_bytes_per_step"] / read_bw + row["written_bytes_per_step"] / write_bw
        on_disk = row["variant"].startswith("spill-disk") or row["variant"] == "largest-1GB"
        row["floor_s"] = max(compute or 0.0, io) if on_disk else None
        row["vs_floor"] = row["step_s"] / row["floor_s"] if row["floor_s"] else None
    print()
    print(
        "| variant | step ms | vs in-memory | shards (recomputing) | MiB read + written per step | floor ms | vs floor "
        "| optimizer ms | fit s | anonymous memory growth MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        moved = (r["read_bytes_per_step"] + r["written_bytes_per_step"]) / 2**20
        shards = f"{r['shards']} ({r['recomputing_shards']})" if r["shards"] else "-"
        print(
            f"| {r['variant']} | {1000 * r['step_s']:.0f} | {_ratio(r['vs_in_memory'])} | {shards} | {moved:.0f} "
            f"| {_ms(r['floor_s'])} | {_ratio(r['vs_floor'])} | {_ms(r['optimizer_s'])} | {r['fit_s']:.1f} "
            f"| {r['anonymous_growth_bytes'] / 2**20:.0f} |"
        )
    for r in rows:
        if r["budget_bytes"]:
            print(
                f"{r['variant']}: {r['parameters'] / 1e6:.1f} M parameters, state (parameters, gradients, AdamW) "
                f"{r['state_bytes'] / 2**20:.0f} MiB, budget {r['budget_bytes'] / 2**20:.1f} MiB: "
                f"{r['state_bytes'] / r['budget_bytes']:.1f}x"
            )
    if "spill-disk" in by_name and "spill-disk-no-prefetch" in by_name:
        ratio = by_name["spill-disk-no-prefetch"]["step_s"] / by_name["spill-disk"]["step_s"]
        print(f"prefetch: {ratio:.2f}x faster than without")
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


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def _ms(seconds: float | None) -> str:
    return f"{1000 * seconds:.0f}" if seconds else "-"


if __name__ == "__main__":
    main()
