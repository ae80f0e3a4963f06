"""SpillingStrategy on one GPU against what users would pick instead, side by side: the model in GPU memory, and
FSDP2's CPU offload.

Run from the repository root on a machine with a CUDA GPU (about 3 minutes on an H200)::

    python benchmarks/gpu_spilling.py

The model is examples/gpt.py's GPT (tied head, a CutPoint after each block), by default at 16 layers, dim 1024,
block 1024 and a vocabulary of 50304 (254 M parameters; 4.1 GB of fp32 parameters, gradients and AdamW's two
moments), trained with AdamW on random tokens, ``--batch`` rows a step, each variant in a fresh process:

* ``in-gpu``: plain Lightning, ``Trainer(accelerator="gpu", devices=1, precision="bf16-mixed")``: everything in
  GPU memory;
* ``fsdp2-offload``: torch's FSDP2 on one GPU as its users write it, a plain training loop:
  ``fully_shard(block, offload_policy=CPUOffloadPolicy(), mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32))`` on each block, then on the model; parameters, gradients and AdamW's state stay in pinned
  host memory, each block's parameters come to the GPU for its forward and backward, and AdamW steps on the CPU;
* ``spill-host``: ``SpillingStrategy(memory_budget=--budget, spill_dir=None)`` with ``bf16-mixed`` (where the
  strategy refuses the budget as too small, the budget its refusal names that fetches each shard ahead): shards of
  the model (parameters, gradients and AdamW's state) in pinned host memory, each brought to the GPU for its
  forward, backward and optimizer step, the next one fetched meanwhile;
* ``spill-disk``: the same with ``spill_dir`` a folder on the disk: shards in files, read and written every step.

Reported for each: the median step time (the GPU synchronized at every step's end), tokens/s, the whole ``fit``
(or loop, set-up included), the bytes the spilled runs' store read and wrote a step (on the disk tier, against the
disk's floor: bytes read / read bandwidth + bytes written / write bandwidth, measured as
``benchmarks/spilling.py`` does), the peak of ``torch.cuda.max_memory_allocated``, and the process's host memory: its
peak resident set (``VmHWM``, which counts pinned buffers and CUDA's own host memory) and the growth of its
anonymous memory over the run. From those, the host memory each variant needs per parameter, and so the largest
model each trains on this machine: FSDP2's offload keeps the whole training state in host memory; the disk tier
keeps a few shards there and the rest on the disk.

Writes ``benchmarks/results/gpu_spilling.json`` (``--out`` for another file). ``--accelerator cpu`` with a small
shape runs the Lightning variants on the CPU to check the script without a GPU (FSDP2 there without offload).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import SpillingStrategy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_throughput import add_gpt_arguments, gpt_and_tokens, run_worker, timed_trainer  # noqa: E402
from spilling import AnonymousMemory, disk_bandwidth  # noqa: E402

VARIANTS = ["in-gpu", "fsdp2-offload", "spill-host", "spill-disk"]


class StepTimer(L.Callback):
    """Each step's seconds, the device synchronized at its end, and the bytes a spilled model's store read and
    wrote at each step's end."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.moved: list[tuple[int, int]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_s.append(time.perf_counter() - self._start)
        sharded = getattr(trainer.strategy, "_sharded", None)
        if sharded is not None:
            self.moved.append((sharded.store.bytes_read, sharded.store.bytes_written))


def peak_resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def lightning_steps(variant: str, args: argparse.Namespace, model: L.LightningModule, data: TensorDataset) -> dict:
    if not variant.startswith("spill"):
        return lightning_fit("auto", args, model, data)
    spill_dir = tempfile.mkdtemp(dir=args.spill_dir) if variant == "spill-disk" else None
    try:
        try:
            strategy = SpillingStrategy(memory_budget=args.budget, spill_dir=spill_dir)
            result = lightning_fit(strategy, args, model, data)
        except ValueError as refusal:  # too small a budget for this device: the one that fetches ahead
            named = re.findall(r"`memory_budget=(\d+)`", str(refusal))  # the one asked, the smallest, the fetching
            if len(named) != 3:
                raise
            strategy = SpillingStrategy(memory_budget=int(named[2]), spill_dir=spill_dir)
            result = lightning_fit(strategy, args, model, data)
    finally:
        if spill_dir:
            shutil.rmtree(spill_dir, ignore_errors=True)
    return dict(result, shards=len(strategy.shards), budget_bytes=strategy.budget_bytes)


def lightning_fit(strategy: Any, args: argparse.Namespace, model: L.LightningModule, data: TensorDataset) -> dict:
    timer = StepTimer()
    trainer = timed_trainer(args, strategy, timer)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    if not timer.moved:
        return {"step_s": timer.step_s}
    (read_before, written_before), (read, written) = timer.moved[args.warmup - 1], timer.moved[-1]
    return {
        "step_s": timer.step_s,
        "read_bytes_per_step": (read - read_before) / args.steps,
        "written_bytes_per_step": (written - written_before) / args.steps,
    }


def fsdp2_offload_steps(args: argparse.Namespace, model: L.LightningModule, data: TensorDataset) -> dict:
    """FSDP2 on one device in a plain loop; with CPU offload and bf16 parameters on a GPU."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    on_gpu = args.accelerator == "gpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    options: dict[str, Any] = {}
    if on_gpu:
        options = dict(
            offload_policy=CPUOffloadPolicy(),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    for module in model.modules():  # FSDP2 may leave buffers (the blocks' attention masks) where they were
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.hparams.lr)
    step_s = []
    for idx, y in DataLoader(data, batch_size=args.batch):
        start = time.perf_counter()
        idx, y = idx.to(device), y.to(device)
        loss = F.cross_entropy(model(idx).flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_gpu:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {"step_s": step_s}


def worker(variant: str, args: argparse.Namespace, out: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    model, data = gpt_and_tokens(args, args.batch * (args.warmup + args.steps))
    parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    with AnonymousMemory() as memory:
        if variant == "fsdp2-offload":
            result = fsdp2_offload_steps(args, model, data)
        else:
            result = lightning_steps(variant, args, model, data)
    step_s = statistics.median(result.pop("step_s")[args.warmup :])
    result.update(
        variant=variant,
        parameters=parameters,
        step_s=step_s,
        tokens_per_s=args.batch * args.block / step_s,
        fit_s=time.perf_counter() - start,
        peak_gpu_bytes=torch.cuda.max_memory_allocated() if args.accelerator == "gpu" else None,
        peak_resident_bytes=peak_resident_bytes(),
        anonymous_growth_bytes=memory.growth,
    )
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gpt_arguments(parser, layers=16, dim=1024, heads=16, batch=4, warmup=2, steps=4)
    parser.add_argument("--budget", default="2.4GB", help="SpillingStrategy's memory_budget (the state: 4.1 GB)")
    parser.add_argument("--spill-dir", default=tempfile.gettempdir(), help="folder on the disk of the disk tier")
    parser.add_argument("--port", type=int, default=29571, help="FSDP2's process group of one")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_spilling.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args, Path(args.worker_out))
        return

    rows = []
    for variant in args.variants:
        row = run_worker(variant, args.out)
        if "error" in row:
            rows.append(row)
            continue
        row["host_bytes_per_parameter"] = row["anonymous_growth_bytes"] / row["parameters"]
        rows.append(row)
        gib = 2.0**30
        print(
            f"{variant}: {row['step_s'] * 1e3:.0f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, "
            f"fit {row['fit_s']:.1f} s, peak GPU {(row['peak_gpu_bytes'] or 0) / gib:.2f} GiB, "
            f"peak resident {row['peak_resident_bytes'] / gib:.2f} GiB, "
            f"anonymous growth {row['anonymous_growth_bytes'] / gib:.2f} GiB",
            flush=True,
        )
    read, write = disk_bandwidth(args.spill_dir, 64 << 20)
    machine = {
        "device": torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu",
        "torch": torch.__version__,
        "lightning": L.__version__,
        "host_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "disk_free_bytes": shutil.disk_usage(args.spill_dir).free,
        "disk_read_bytes_per_s": read,
        "disk_write_bytes_per_s": write,
    }
    print(f"disk: read {read / 1e9:.2f} GB/s, write {write / 1e9:.2f} GB/s", flush=True)
    for row in rows:
        if row["variant"] == "spill-disk" and "error" not in row:
            row["disk_floor_s"] = row["read_bytes_per_step"] / read + row["written_bytes_per_step"] / write
            print(f"spill-disk: {row['step_s'] / row['disk_floor_s']:.2f}x the disk's floor", flush=True)
    shape = {k: getattr(args, k) for k in ("layers", "dim", "heads", "block", "vocab", "batch", "precision", "budget")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine, "shape": shape, "variants": rows}, indent=2))


if __name__ == "__main__":
    main()
