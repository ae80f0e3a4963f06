"""A sweep of models of unequal sizes and lengths on D CPU devices: one after another, as a task queue would run
them, and with MultiModelTrainer, side by side.

Run from the repository root (about 3 minutes on 2 CPU cores)::

    python benchmarks/multi_model.py

The models are MLPs of Linear(width, width) layers with a CutPoint after each, trained with AdamW on batches of
``--batch`` rows; a device is one core (one torch thread). The sweep is ordered as a researcher might add it:
shortest first. Three ways to train it:

* ``sequential``: each model alone, one after another, with Lightning's default strategy, one thread. Its times are
  the tᵢ of the lower bound max(Σ tᵢ / D, max tᵢ), and its makespan is Σ tᵢ;
* ``task-queue``: D worker processes (one thread each) taking whole models first come, first served, as a job queue
  or ``multiprocessing.Pool`` does; each model with Lightning's default strategy;
* ``multi-model``: ``MultiModelTrainer(devices=D)`` with the default budget (what the machine has free: on the CPU
  every model is one shard): each model's forward, backward and optimizer step take turns on the D devices, the model
  with the longest remaining time first;
* ``multi-model-spilled``: the same with ``--budget`` (a few layers per shard): turns a shard at a time, each
  shard's forward recomputed for its backward, as when the models do not fit the device.

Writes ``benchmarks/results/multi_model.json`` and the spilled sweep's device timeline as a Perfetto trace,
``benchmarks/results/traces/multi_model.json`` (open it in ui.perfetto.dev); with another ``--batch``,
``multi_model_batch<batch>.json`` in both places.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import CutPoint, MultiModelTrainer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_BATCH = 256
# (width, layers, steps at DEFAULT_BATCH) of each model, in the order added: unequal sizes and lengths, the longest
# last. At another ``--batch`` the steps are scaled so that each model trains on as many rows.
SWEEP = [(512, 4, 80), (768, 4, 60), (512, 6, 120), (1024, 4, 80), (768, 6, 100), (1024, 6, 120)]


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
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def model_and_data(index: int, batch: int) -> tuple[MLP, DataLoader, int]:
    width, layers, steps = SWEEP[index]
    steps = max(1, round(steps * DEFAULT_BATCH / batch))
    torch.manual_seed(index)
    data = TensorDataset(torch.randn(batch * 8, width), torch.randn(batch * 8, width))
    return MLP(width, layers), DataLoader(data, batch_size=batch), steps


QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def train_alone(index: int, batch: int) -> float:
    """Train model ``index`` alone with Lightning's default strategy, one thread; its wall time."""
    torch.set_num_threads(1)
    model, loader, steps = model_and_data(index, batch)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, **QUIET)
    start = time.perf_counter()
    trainer.fit(model, loader)
    return time.perf_counter() - start


def sequential(batch: int) -> list[float]:
    return [train_alone(i, batch) for i in range(len(SWEEP))]


def task_queue(devices: int, batch: int) -> float:
    """D worker processes take whole models in the order added; the makespan from the first model's start."""
    with multiprocessing.get_context("spawn").Pool(devices, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        pool.map(time.sleep, [1.0] * devices)  # every worker started and idle
        start = time.perf_counter()
        pool.starmap(train_alone, [(i, batch) for i in range(len(SWEEP))], chunksize=1)
        return time.perf_counter() - start


def multi_model(devices: int, batch: int, budget: str | None) -> tuple[float, MultiModelTrainer]:
    sweep = MultiModelTrainer(accelerator="cpu", devices=devices, memory_budget=budget)
    for i in range(len(SWEEP)):
        model, loader, steps = model_and_data(i, batch)
        width, layers, _ = SWEEP[i]
        sweep.add(model, train_dataloaders=loader, max_steps=steps, name=f"{width}x{layers}", **QUIET)
    start = time.perf_counter()
    sweep.fit()
    makespan = time.perf_counter() - start
    failed = [r for r in sweep.results if r.status != "finished"]
    if failed:
        raise RuntimeError(f"models did not finish: {[(r.name, r.status, r.error) for r in failed]}")
    return makespan, sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per batch (steps scaled to match)")
    parser.add_argument("--budget", default="64MB", help="each model's memory budget (a shard's)")
    args = parser.parse_args()

    print(f"sweep of {len(SWEEP)} models (width, layers, steps at batch {DEFAULT_BATCH}): {SWEEP}")
    print(f"{args.devices} devices, batches of {args.batch}")
    alone = sequential(args.batch)
    print("sequential: " + ", ".join(f"{t:.1f}s" for t in alone))
    queue_s = task_queue(args.devices, args.batch)
    print(f"task queue: {queue_s:.1f}s")
    sweep_s, sweep = multi_model(args.devices, args.batch, None)
    print(f"multi-model: {sweep_s:.1f}s")
    spilled_s, spilled = multi_model(args.devices, args.batch, args.budget)
    print(f"multi-model-spilled: {spilled_s:.1f}s")

    file_name = "multi_model.json" if args.batch == DEFAULT_BATCH else f"multi_model_batch{args.batch}.json"
    results_path, trace_path = RESULTS / file_name, RESULTS / "traces" / file_name
    lower_bound = max(sum(alone) / args.devices, max(alone))
    rows = {
        "sequential": sum(alone),
        "task-queue": queue_s,
        "multi-model": sweep_s,
        "multi-model-spilled": spilled_s,
    }
    busy = {
        name: sum(s.end_s - s.start_s for s in run.spans) / (args.devices * makespan)
        for name, run, makespan in (("multi-model", sweep, sweep_s), ("multi-model-spilled", spilled, spilled_s))
    }
    results = {
        "command": shlex.join(["python", "benchmarks/multi_model.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "devices": args.devices,
        "batch": args.batch,
        "memory_budget": args.budget,
        "models": [
            {"width": w, "layers": n, "steps": r.steps, "alone_s": t, "shards_spilled": len(r.trainer.strategy.shards)}
            for (w, n, _), t, r in zip(SWEEP, alone, spilled.results)
        ],
        "lower_bound_s": lower_bound,
        "makespan_s": rows,
        "speedup_over_sequential": {k: sum(alone) / v for k, v in rows.items()},
        "vs_lower_bound": {k: v / lower_bound for k, v in rows.items()},
        "device_busy": busy,
        "trace": str(trace_path.relative_to(ROOT)),
    }
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    spilled.write_trace(trace_path)
    print(f"\nlower bound max(sum t / D, max t) = {lower_bound:.1f}s")
    print(f"{'':20} {'makespan s':>10} {'speed-up':>9} {'vs bound':>9} {'devices busy':>13}")
    for name, makespan in rows.items():
        shown = f"{busy[name]:.0%}" if name in busy else "-"
        print(f"{name:20} {makespan:10.1f} {sum(alone) / makespan:8.2f}x {makespan / lower_bound:8.2f}x {shown:>13}")
    print(f"wrote {results_path.relative_to(ROOT)} and {trace_path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
