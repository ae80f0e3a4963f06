"""A sweep of models of unequal sizes and lengths on D CPU devices: one after another, as a task queue would run
them, and with MultiModelTrainer, side by side.

Run from the repository root (about 3 minutes on 2 CPU cores)::

    python benchmarks/multi_model.py

``--rounds N`` trains the sweep every way N times in turn, since a slow spell of a shared machine can move one
makespan by 5-10%: each round's table, and the median ratio to the lower bound over the rounds. ``--accelerator gpu``
trains on one CUDA GPU instead (``--devices 1``; no task queue, which is the sequential run on one device); how busy
the GPU was is then measured by CUDA events around the turns, and the trace has a row for the GPU's time besides the
host's.

The models are MLPs (`lightning_varuna.demos.MLP`) of Linear(width, width) layers with a CutPoint after each,
trained with AdamW on batches of ``--batch`` rows; a device is one core (one torch thread). The sweep is ordered as a
researcher might add it: shortest first. The ways to train it:

* ``sequential``: each model alone, one after another, with Lightning's default strategy, one thread. Its times are
  the tᵢ of the lower bound max(Σ tᵢ / D, max tᵢ), and its makespan is Σ tᵢ;
* ``task-queue``: D worker processes (one thread each) taking whole models first come, first served, as a job queue
  or ``multiprocessing.Pool`` does; each model with Lightning's default strategy;
* ``multi-model``: ``MultiModelTrainer(devices=D)`` with the default budget (what the machine has free: on the CPU
  every model is one shard): each model's forward, backward and optimizer step take turns on the D devices, the model
  with the longest remaining time first;
* ``multi-model-processes``: ``MultiModelTrainer(devices=D, processes=True)``: each model alone in one of D worker
  processes forked as the sweep starts, the most work (steps times parameters) first;
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
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import MultiModelTrainer
from lightning_varuna.demos import MLP

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_BATCH = 256
# (width, layers, steps at DEFAULT_BATCH) of each model, in the order added: unequal sizes and lengths, the longest
# last. At another ``--batch`` the steps are scaled so that each model trains on as many rows.
SWEEP = [(512, 4, 80), (768, 4, 60), (512, 6, 120), (1024, 4, 80), (768, 6, 100), (1024, 6, 120)]


def model_and_data(index: int, batch: int) -> tuple[MLP, DataLoader, int]:
    width, layers, steps = SWEEP[index]
    steps = max(1, round(steps * DEFAULT_BATCH / batch))
    torch.manual_seed(index)
    data = TensorDataset(torch.randn(batch * 8, width), torch.randn(batch * 8, width))
    return MLP(width, layers, lr=1e-4), DataLoader(data, batch_size=batch), steps


QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def train_alone(index: int, batch: int, accelerator: str = "cpu") -> float:
    """Train model ``index`` alone with Lightning's default strategy, one thread (on the CPU); its wall time."""
    if accelerator == "cpu":
        torch.set_num_threads(1)
    model, loader, steps = model_and_data(index, batch)
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=steps, **QUIET)
    start = time.perf_counter()
    trainer.fit(model, loader)
    return time.perf_counter() - start


def sequential(batch: int, accelerator: str) -> list[float]:
    return [train_alone(i, batch, accelerator) for i in range(len(SWEEP))]


def task_queue(devices: int, batch: int) -> float:
    """D worker processes take whole models in the order added; the makespan from the first model's start."""
    with multiprocessing.get_context("spawn").Pool(devices, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        pool.map(time.sleep, [1.0] * devices)  # every worker started and idle
        start = time.perf_counter()
        pool.starmap(train_alone, [(i, batch) for i in range(len(SWEEP))], chunksize=1)
        return time.perf_counter() - start


def multi_model(
    devices: int, batch: int, budget: str | None, accelerator: str, processes: bool = False
) -> tuple[float, MultiModelTrainer]:
    sweep = MultiModelTrainer(accelerator=accelerator, devices=devices, memory_budget=budget, processes=processes)
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


def one_round(devices: int, batch: int, budget: str, accelerator: str) -> tuple[dict[str, Any], MultiModelTrainer]:
    """Every way of training the sweep once: the models alone (their tᵢ), the task queue (on the CPU) and both
    sweeps; the figures, and the spilled sweep (for its timeline)."""
    alone = sequential(batch, accelerator)
    print("sequential: " + ", ".join(f"{t:.1f}s" for t in alone), flush=True)
    makespans = {"sequential": sum(alone)}
    if accelerator == "cpu":
        makespans["task-queue"] = task_queue(devices, batch)
        print(f"task queue: {makespans['task-queue']:.1f}s", flush=True)
    makespans["multi-model"], sweep = multi_model(devices, batch, None, accelerator)
    print(f"multi-model: {makespans['multi-model']:.1f}s", flush=True)
    if accelerator == "cpu":  # each model alone in one of D worker processes, the most work first
        makespans["multi-model-processes"], _ = multi_model(devices, batch, None, accelerator, processes=True)
        print(f"multi-model-processes: {makespans['multi-model-processes']:.1f}s", flush=True)
    makespans["multi-model-spilled"], spilled = multi_model(devices, batch, budget, accelerator)
    print(f"multi-model-spilled: {makespans['multi-model-spilled']:.1f}s", flush=True)
    sweep_s, spilled_s = makespans["multi-model"], makespans["multi-model-spilled"]
    lower_bound = max(sum(alone) / devices, max(alone))
    row = {
        "alone_s": alone,
        "lower_bound_s": lower_bound,
        "makespan_s": makespans,
        "vs_lower_bound": {k: v / lower_bound for k, v in makespans.items()},
        "device_busy": {
            name: sum(s.end_s - s.start_s for s in run.gpu_spans or run.spans) / (devices * makespan)
            for name, run, makespan in (("multi-model", sweep, sweep_s), ("multi-model-spilled", spilled, spilled_s))
        },
    }
    return row, spilled


def shown(path: Path) -> str:
    """``path`` relative to the repository, if it is in it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per batch (steps scaled to match)")
    parser.add_argument("--budget", default="64MB", help="each model's memory budget (a shard's)")
    parser.add_argument("--rounds", type=int, default=1, help="train the sweep every way this many times, in turn")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results and the trace")
    args = parser.parse_args()

    print(f"sweep of {len(SWEEP)} models (width, layers, steps at batch {DEFAULT_BATCH}): {SWEEP}")
    print(f"{args.devices} devices, batches of {args.batch}")
    rounds = []
    for index in range(args.rounds):
        if args.rounds > 1:
            print(f"round {index + 1} of {args.rounds}", flush=True)
        row, spilled = one_round(args.devices, args.batch, args.budget, args.accelerator)
        rounds.append(row)
    ways = list(rounds[0]["makespan_s"])
    median = {way: statistics.median(r["vs_lower_bound"][way] for r in rounds) for way in ways}

    file_name = "multi_model.json" if args.batch == DEFAULT_BATCH else f"multi_model_batch{args.batch}.json"
    file_name = file_name if args.accelerator == "cpu" else file_name.replace("multi_model", "multi_model_gpu")
    results_path, trace_path = args.out / file_name, args.out / "traces" / file_name
    results = {
        "command": shlex.join(["python", "benchmarks/multi_model.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.accelerator == "gpu" else None,
        },
        "devices": args.devices,
        "batch": args.batch,
        "memory_budget": args.budget,
        "models": [
            {"width": w, "layers": n, "steps": r.steps, "shards_spilled": len(r.trainer.strategy.shards)}
            for (w, n, _), r in zip(SWEEP, spilled.results)
        ],
        "rounds": rounds,
        "median_vs_lower_bound": median,
        "trace": shown(trace_path),
    }
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    spilled.write_trace(trace_path)
    for index, r in enumerate(rounds):
        print(f"\nround {index + 1}: lower bound max(sum t / D, max t) = {r['lower_bound_s']:.1f}s")
        print(f"{'':20} {'makespan s':>10} {'speed-up':>9} {'vs bound':>9} {'devices busy':>13}")
        for way, makespan in r["makespan_s"].items():
            busy = f"{r['device_busy'][way]:.0%}" if way in r["device_busy"] else "-"
            speedup = r["makespan_s"]["sequential"] / makespan
            print(f"{way:20} {makespan:10.1f} {speedup:8.2f}x {r['vs_lower_bound'][way]:8.2f}x {busy:>13}")
    if args.rounds > 1:
        medians = ", ".join(f"{way} {median[way]:.2f}x" for way in ways)
        print(f"\nmedian of {args.rounds} rounds, vs the lower bound: {medians}")
    print(f"wrote {shown(results_path)} and {shown(trace_path)}")


if __name__ == "__main__":
    main()
