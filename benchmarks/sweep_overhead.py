"""What a one-device sweep costs a trial that has the device to itself, against plain Lightning: per step, and per
trial (set-up and end), side by side in one process. This is all that separates ``optimize(processes=True)``, one
trial per device, from Optuna's own worker processes (`benchmarks/model_selection.py`).

Run from the repository root (under a minute on 2 CPU cores)::

    python benchmarks/sweep_overhead.py

One of `model_selection.py`'s trials (an MLP regressor, width 512, 2 layers, batches of 64, validation every 10
steps) trained ``--steps`` steps (300) three ways, in turn, ``--rounds`` times (5) after a warm-up fit of each, on one
thread: plain Lightning (``Trainer(strategy="auto")``), Lightning with ``SpillingStrategy()`` (the model fits, so it
stays on the device in one shard: what is left is the strategy's own code per step), and a one-device
``MultiModelTrainer`` with the model alone in it (the sweep's turns and callbacks added). Each way's fastest ``fit``
is kept, and the cost per step is its difference to plain Lightning over the steps. Then the same with ``--steps
10``: what is left over the steps there is the cost per trial. Writes ``benchmarks/results/sweep_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from lightning_varuna import MultiModelTrainer, SpillingStrategy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from model_selection import QUIET, VALIDATION, model_and_loaders  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "sweep_overhead.json"
WIDTH, LAYERS, LR = 512, 2, 0.01


def plain(steps: int) -> None:
    model, train, val = model_and_loaders(WIDTH, LAYERS, LR)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, enable_model_summary=False, **VALIDATION, **QUIET
    )
    trainer.fit(model, train, val)


def spilling(steps: int) -> None:
    model, train, val = model_and_loaders(WIDTH, LAYERS, LR)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=SpillingStrategy(), max_steps=steps, enable_model_summary=False,
        **VALIDATION, **QUIET,
    )  # fmt: skip
    trainer.fit(model, train, val)


def sweep(steps: int) -> None:
    model, train, val = model_and_loaders(WIDTH, LAYERS, LR)
    trainers = MultiModelTrainer(accelerator="cpu", devices=1, enable_progress_bar=False)
    trainers.add(model, train_dataloaders=train, val_dataloaders=val, max_steps=steps, **VALIDATION, **QUIET)
    trainers.fit()


WAYS: dict[str, Callable[[int], None]] = {"plain Lightning": plain, "SpillingStrategy": spilling, "sweep": sweep}


def fastest(steps: int, rounds: int) -> dict[str, float]:
    """Each way's fastest fit of ``steps`` steps over ``rounds`` rounds, the ways in turn, after a warm-up fit each."""
    for way in WAYS.values():
        way(steps)
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(rounds):
        for name, way in WAYS.items():
            start = time.perf_counter()
            way(steps)
            times[name].append(time.perf_counter() - start)
    return {name: min(runs) for name, runs in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_varuna"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    long, short = fastest(args.steps, args.rounds), fastest(10, args.rounds)
    base_long, base_short = long["plain Lightning"], short["plain Lightning"]
    print(f"torch {torch.__version__}, lightning {L.__version__}, {args.rounds} rounds, fastest fit of each way")
    print(f"| way | {args.steps} steps s | vs plain | per step ms | 10 steps s | per trial ms |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name in WAYS:
        per_step = (long[name] - base_long) / args.steps
        per_trial = (short[name] - base_short) - 10 * per_step
        rows.append({"way": name, "long_s": long[name], "per_step_s": per_step, "short_s": short[name],
                     "per_trial_s": per_trial})  # fmt: skip
        print(
            f"| {name} | {long[name]:.3f} | {long[name] / base_long:.3f}x | {per_step * 1e3:+.3f} | {short[name]:.3f} "
            f"| {per_trial * 1e3:+.1f} |"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "steps": args.steps,
                "rounds": args.rounds,
                "torch": torch.__version__,
                "lightning": L.__version__,
                "machine": platform.machine(),
                "rows": rows,
            },  # fmt: skip
            indent=1,
        )
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
