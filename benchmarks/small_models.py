"""A sweep of many small models on D CPU devices: each model's step takes a few milliseconds, so what a sweep costs
between the turns (handing a device from one model's thread to another's, Lightning's code between steps) weighs as
much as the work. How close does `MultiModelTrainer.fit` come to the lower bound?

Run from the repository root (about 2 minutes on 2 CPU cores)::

    python benchmarks/small_models.py

The models: ``--models`` (32) GPTs of ``examples/gpt.py`` (6 layers, width 48, 4 heads, block 32, batches of 8,
a CutPoint after each block, every model one shard), 30 to 90 steps each. Each is trained alone first with
Lightning's default strategy on one thread: its wall time is its tᵢ, and the lower bound of a sweep on D devices is
max(Σ tᵢ / D, max tᵢ). Then, side by side, the sweep ``MultiModelTrainer(devices=D).fit()`` as it runs by default
and with each of its savings for small models undone (``--variants``, see `VARIANTS`), and the same models trained
with plain Lightning by D threads of this process, each taking the next model as it finishes one (a task queue in
threads: what Python's global interpreter lock leaves of D devices for work this small). ``--profile FILE`` writes
the default sweep's cProfile statistics (every model's thread, summed) to FILE instead of the results. Writes
``benchmarks/results/small_models.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import queue
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_varuna import MultiModelTrainer
from lightning_varuna.multimodel.member import SweepMemberStrategy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, CharDataset, make_text  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "small_models.json"
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
BLOCK, BATCH = 32, 8

# How the sweep runs: the default, and with one of its savings for small models undone each.
VARIANTS: dict[str, dict[str, bool]] = {
    "default": {},  # a one-shard model stays in host memory, one turn a step, its thread pinned once per core
    "a turn each for forward and backward": {"step_in_one_turn": False},
    "threads not pinned": {"pin": False},
    "spilled between turns": {"keep_on_device": False},  # and a turn each for forward and backward
    "worker processes": {"processes": True},  # each model alone in one of D forked processes, the most work first
}


def model_and_data(index: int) -> tuple[GPT, DataLoader, int]:
    data = CharDataset(make_text(400), BLOCK)
    torch.manual_seed(index)
    model = GPT(len(data.vocab), block_size=BLOCK, dim=48, layers=6, heads=4, lr=3e-3)
    return model, DataLoader(data, batch_size=BATCH), 30 + 20 * (index % 4)


def train_alone(index: int) -> float:
    """Model ``index`` trained alone with Lightning's default strategy, one thread: its wall time."""
    model, loader, steps = model_and_data(index)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, **QUIET)
    start = time.perf_counter()
    trainer.fit(model, loader)
    return time.perf_counter() - start


def threads_fit(models: int, devices: int) -> float:
    """The models trained with plain Lightning by ``devices`` threads, each taking the next model when it is done."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(models):
        todo.put(index)

    def work() -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            model, loader, steps = model_and_data(index)
            L.Trainer(accelerator="cpu", devices=1, max_steps=steps, **QUIET).fit(model, loader)

    threads = [threading.Thread(target=work) for _ in range(devices)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def sweep_fit(
    models: int, devices: int, profile: Path | None, variant: dict[str, bool] | None = None
) -> tuple[float, MultiModelTrainer]:
    variant = variant or {}
    sweep = MultiModelTrainer(
        accelerator="cpu",
        devices=devices,
        enable_progress_bar=False,
        keep_on_device=variant.get("keep_on_device"),
        processes=variant.get("processes", False),
    )
    sweep.scheduler.pin = variant.get("pin", True)
    SweepMemberStrategy.step_in_one_turn = variant.get("step_in_one_turn", True)
    for index in range(models):
        model, loader, steps = model_and_data(index)
        sweep.add(model, train_dataloaders=loader, max_steps=steps, name=f"gpt{index}", **QUIET)
    profiles: list[cProfile.Profile] = []
    if profile is not None:  # each model's thread under a profiler of its own
        fit_member = sweep._fit_member

        def profiled(*args: Any) -> None:
            profiler = cProfile.Profile()
            profiles.append(profiler)
            profiler.runcall(fit_member, *args)

        sweep._fit_member = profiled  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        sweep.fit()
    finally:
        SweepMemberStrategy.step_in_one_turn = True
    makespan = time.perf_counter() - start
    if profile is not None:
        pstats.Stats(*profiles).dump_stats(profile)
    failed = [r for r in sweep.results if r.status != "finished"]
    if failed:
        raise RuntimeError(f"models did not finish: {[(r.name, r.status, r.error) for r in failed]}")
    return makespan, sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=32)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--profile", type=Path, default=None, help="write the sweep's cProfile statistics here")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--no-threads", action="store_true", help="skip plain Lightning in D threads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    for index in range(min(args.models, 2)):  # warm up: the first fit of a process imports and compiles
        model, loader, _ = model_and_data(index)
        L.Trainer(accelerator="cpu", devices=1, max_steps=2, **QUIET).fit(model, loader)
    alone = [train_alone(i) for i in range(args.models)]
    steps = [model_and_data(i)[2] for i in range(args.models)]
    per_step_ms = 1e3 * sum(alone) / sum(steps)
    bound = max(sum(alone) / args.devices, max(alone))
    print(f"{args.models} models alone: {sum(alone):.1f} s in all, {per_step_ms:.1f} ms a step with its fit's ends")
    if args.profile is not None:  # the profiler slows the sweep: its figures are not the sweep's
        makespan, sweep = sweep_fit(args.models, args.devices, args.profile)
        print(f"sweep.fit under the profiler {makespan:.2f} s; wrote the profile to {args.profile}")
        return
    print(f"lower bound max(sum t / D, max t) = {bound:.2f} s")
    sweeps = {}
    for name in args.variants:
        makespan, sweep = sweep_fit(args.models, args.devices, None, VARIANTS[name])
        busy = sum(s.end_s - s.start_s for s in sweep.spans) / (args.devices * makespan)
        turns = len(sweep.spans)
        sweeps[name] = {
            "sweep_s": makespan,
            "vs_lower_bound": makespan / bound,
            "device_busy": busy,
            "turns": turns,
        }
        print(
            f"sweep.fit, {name}: {makespan:.2f} s = {makespan / bound:.2f}x; devices busy {busy:.0%}, {turns} turns "
            f"({1e3 * busy * makespan * args.devices / turns:.2f} ms each)"
        )
    threads_s = None
    if not args.no_threads:
        threads_s = threads_fit(args.models, args.devices)
        print(f"plain Lightning in {args.devices} threads: {threads_s:.2f} s = {threads_s / bound:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "command": shlex.join(["python", "benchmarks/small_models.py", *sys.argv[1:]]),
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                    "load_average": {"start": load_before, "end": os.getloadavg()},
                },
                "devices": args.devices,
                "models": args.models,
                "steps": steps,
                "alone_s": alone,
                "lower_bound_s": bound,
                "sweeps": sweeps,
                "threads_s": threads_s,
                "threads_vs_lower_bound": threads_s / bound if threads_s is not None else None,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
