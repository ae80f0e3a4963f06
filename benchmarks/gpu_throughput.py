"""Tokens/s and model FLOPs utilization (MFU) of examples/gpt.py's GPT at a GPU size, on one GPU, side by side.

Run from the repository root on a machine with a CUDA GPU (about 2 minutes on an H200)::

    python benchmarks/gpu_throughput.py

The model is examples/gpt.py's GPT (tied head, a CutPoint after each block) at 12 layers, dim 768, 12 heads,
block 1024 and a vocabulary of 50304 (124 M parameters, GPT-2 small's shape), trained with AdamW in
``bf16-mixed`` on random tokens, ``--batch`` rows of ``--block`` tokens a step. Each variant runs in a fresh
process:

* ``lightning``: plain Lightning, ``Trainer(accelerator="gpu", devices=1)``;
* ``varuna-1-stage``: ``VarunaStrategy(pipeline_parallel_size=1)``, the whole batch one micro-batch: the strategy's
  own overhead on one GPU;
* ``varuna-2-stages-shared``: ``VarunaStrategy(pipeline_parallel_size=2)`` with both stages' processes on the one
  GPU (``parallel_devices=[cuda:0] * 2``, gloo, messages staged through pinned host memory), 4 micro-batches of
  1F1B. Not a speed-up: the stages share the GPU's time; the figure is the pipeline runtime's cost on it.

Each is timed over ``--steps`` steps after ``--warmup`` (the GPU synchronized at both ends); the whole ``fit`` and
the peak of ``torch.cuda.max_memory_allocated`` per process are reported beside it. MFU counts nanoGPT's FLOPs
per token, 6 N + 12 L T d (N parameters without the position embedding, which does no arithmetic; the tied
embedding is counted once, as the head's matrix product), against ``--peak-tflops`` (989 for an H100/H200's
dense bf16 by default). ``--accelerator cpu`` with a small shape runs every variant on the CPU, to check the
script without a GPU (no MFU there).

Writes ``benchmarks/results/gpu_throughput.json`` (``--out`` for another file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import VarunaStrategy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT  # noqa: E402  (examples/ is no package)

VARIANTS = ["lightning", "varuna-1-stage", "varuna-2-stages-shared"]
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16, per the vendor's data sheets


class WindowTimer(L.Callback):
    """Seconds from the end of step ``warmup`` to the end of step ``warmup + steps``, the device synchronized at
    both ends, and the whole fit."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.window_s = float("nan")

    def on_fit_start(self, *args: Any) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in (self.warmup, self.warmup + self.steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            if trainer.global_step == self.warmup:
                self._start = now
            else:
                self.window_s = now - self._start


def gpt_and_tokens(args: argparse.Namespace, rows: int) -> tuple[GPT, TensorDataset]:
    """The GPT of ``args``'s shape and ``rows`` rows of random tokens with their next-token targets."""
    torch.manual_seed(0)
    model = GPT(args.vocab, block_size=args.block, dim=args.dim, layers=args.layers, heads=args.heads, lr=3e-4)
    tokens = torch.randint(args.vocab, (rows, args.block + 1))
    return model, TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def timed_trainer(args: argparse.Namespace, strategy: Any, timer: L.Callback, devices: int = 1) -> L.Trainer:
    """A Trainer for ``args``'s warm-up and timed steps with ``timer``, and nothing else (no validation, logger,
    checkpoints or progress bar)."""
    return L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )


def add_gpt_arguments(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """The GPT's shape, precision and steps, and the worker's own arguments; ``defaults`` for layers, dim, heads,
    batch, warmup and steps."""
    parser.add_argument("--accelerator", default="gpu")
    for name in ("layers", "dim", "heads"):
        parser.add_argument(f"--{name}", type=int, default=defaults[name])
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=defaults["batch"], help="rows a step")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--warmup", type=int, default=defaults["warmup"])
    parser.add_argument("--steps", type=int, default=defaults["steps"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)


def run_worker(variant: str, out: str) -> dict:
    """Run ``variant`` in a fresh process (this script again, with ``--worker``): what it wrote, or its ``error``."""
    result_file = Path(out).with_suffix(f".{variant}.part")
    result_file.unlink(missing_ok=True)
    command = [sys.executable, sys.argv[0], *sys.argv[1:], "--worker", variant, "--worker-out", str(result_file)]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0 or not result_file.exists():
        print(f"{variant}: failed (exit {done.returncode})", flush=True)
        return {"variant": variant, "error": f"exit {done.returncode}"}
    row = json.loads(result_file.read_text())
    result_file.unlink()
    return row


def flops_per_token(model: GPT, args: argparse.Namespace) -> float:
    n = sum(p.numel() for p in model.parameters()) - model.pos.numel()
    return 6 * n + 12 * args.layers * args.block * args.dim


def worker(variant: str, args: argparse.Namespace, out: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    model, data = gpt_and_tokens(args, args.batch * (args.warmup + args.steps))
    flops, parameters = flops_per_token(model, args), sum(p.numel() for p in model.parameters())
    on_gpu = args.accelerator == "gpu"
    strategy: Any = "auto"
    devices = 1
    if variant == "varuna-1-stage":
        strategy = VarunaStrategy(pipeline_parallel_size=1, micro_batch_size=args.batch)
    elif variant == "varuna-2-stages-shared":
        shared = [torch.device("cuda", 0)] * 2 if on_gpu else None
        strategy = VarunaStrategy(pipeline_parallel_size=2, micro_batch_size=args.batch // 4, parallel_devices=shared)
        devices = 1 if on_gpu else 2
    timer = WindowTimer(args.warmup, args.steps)
    trainer = timed_trainer(args, strategy, timer, devices)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    fit_s = time.perf_counter() - timer.fit_start
    peak = torch.cuda.max_memory_allocated() if on_gpu else None
    if trainer.global_rank != 0:
        out.with_suffix(f".rank{trainer.global_rank}").write_text(json.dumps(peak))
        return
    tokens_per_s = args.steps * args.batch * args.block / timer.window_s
    result = {
        "variant": variant,
        "step_s": timer.window_s / args.steps,
        "tokens_per_s": tokens_per_s,
        "fit_s": fit_s,
        "peak_gpu_bytes": peak,
        "flops_per_token": flops,
        "parameters": parameters,
    }
    out.write_text(json.dumps(result))


def peak_tflops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops or args.accelerator != "gpu":
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt_arguments(parser, layers=12, dim=768, heads=12, batch=16, warmup=5, steps=20)  # batch: divisible by 4
    parser.add_argument("--peak-tflops", type=float, help="the device's peak at --precision (default: by its name)")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_throughput.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args, Path(args.worker_out))
        return

    peak = peak_tflops(args)
    rows = []
    for variant in args.variants:
        row = run_worker(variant, args.out)
        if "error" in row:
            rows.append(row)
            continue
        others = sorted(Path(args.out).parent.glob(f"{Path(args.out).stem}.{variant}.rank*"))
        row["peak_gpu_bytes_per_process"] = [row.pop("peak_gpu_bytes")] + [json.loads(f.read_text()) for f in others]
        for f in others:
            f.unlink()
        row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / (peak * 1e12) if peak else None
        rows.append(row)
        mfu = f"{row['mfu']:.1%}" if peak else "-"
        print(
            f"{variant}: {row['tokens_per_s']:,.0f} tokens/s, {row['step_s'] * 1e3:.1f} ms/step, MFU {mfu}, "
            f"fit {row['fit_s']:.1f} s, peak GPU bytes {row['peak_gpu_bytes_per_process']}",
            flush=True,
        )
    base = next((r["tokens_per_s"] for r in rows if r["variant"] == "lightning" and "error" not in r), None)
    for row in rows:
        if base and "error" not in row:
            row["vs_lightning"] = row["tokens_per_s"] / base
    machine = {
        "device": torch.cuda.get_device_name() if args.accelerator == "gpu" else platform.processor(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "peak_tflops": peak,
    }
    shape = {k: getattr(args, k) for k in ("layers", "dim", "heads", "block", "vocab", "batch", "precision")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine, "shape": shape, "variants": rows}, indent=2))


if __name__ == "__main__":
    main()
