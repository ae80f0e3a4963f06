"""Peak memory and step time per pipeline stage of the three schedules: GPipe, 1F1B and Varuna's recompute schedule.

Run from the repository root (about 2 minutes on 2 CPU cores)::

    python benchmarks/schedule_memory.py

examples/gpt.py's GPT (8 layers, dim 128, block 256, so activations dominate a stage's memory) is cut into P equal
stages (P = 2 and 4) and trained with lightning-varuna's ``StageRuntime`` on the traced stages ``VarunaStrategy``
builds, 8 micro-batches of 4 sequences per step, 1 thread per process, gloo, fresh processes for every run. For
each stage:

* ``saved MB``: the most bytes autograd held for backward at any moment of a step (tensors saved by the forward,
  counted once per storage, measured with ``torch.autograd.graph.saved_tensors_hooks``; the stage's weights,
  which matmuls save too, are left out). It does not include the
  stage inputs Varuna's schedule keeps between a forward and its recompute (a few MB here).
* ``peak RSS MB``: the process's peak resident memory above what it held before the first step (the model is
  built and cut by then); what the machine had to provide (it includes the optimizer state, a few MB).
* ``step ms``: median wall time of forward + backward + AdamW step.

Writes ``benchmarks/results/schedule_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from pipeline_step import Config, current_rss_mb, make_data, make_model, peak_rss_mb, run_bare_step  # noqa: E402

from lightning_varuna.profiling.memory import SavedTensorMeter  # noqa: E402
from lightning_varuna.profiling.processes import wait_all  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "schedule_memory.json"
SCHEDULES = ("gpipe", "1f1b", "varuna")
CONFIG = Config(block_size=256, batch_size=32, micro_batch_size=4, warmup=2, steps=6)


def worker(schedule: str, stages: int, out: Path) -> None:
    """One rank: build its stage as VarunaStrategy does, run the schedule, write its figures."""

    from lightning_varuna.pipeline.schedules import SCHEDULES as GENERATORS
    from lightning_varuna.pipeline.stage import Stage
    from lightning_varuna.pipeline.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cfg = dist.get_rank(), CONFIG
    data = make_data(cfg)
    model = make_model(cfg, len(data.vocab)).train()
    per_stage = cfg.layers // stages
    boundaries = [f"cuts.{per_stage * s - 1}" for s in range(1, stages)]
    tokens = torch.randint(len(data.vocab), (cfg.warmup + cfg.steps, cfg.batch_size, cfg.block_size + 1))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    example = batches[0][0][: cfg.micro_batch_size]
    topology = Topology.from_world(stages, rank, stages, None)
    plan = Stage(model, boundaries, topology, example.device)
    graph, stage_module = plan.stage_for((example,), {})
    plan.release_other_stages(graph)
    params = plan.own_parameters()
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    actions = GENERATORS[schedule](stages, cfg.num_microbatches)[topology.pp_rank]
    meter, step_s = SavedTensorMeter(exclude=[*stage_module.parameters(), *stage_module.buffers()]), []
    rss_before = current_rss_mb()
    for x, y in batches:
        dist.barrier()
        start = time.perf_counter()
        with meter.measuring():
            run_bare_step(plan, actions, x.split(cfg.micro_batch_size), y.split(cfg.micro_batch_size))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
    result = {
        "rank": rank,
        "stage": topology.pp_rank,
        "step_ms": 1000 * statistics.median(step_s[cfg.warmup :]),
        "saved_mb": meter.peak / 2**20,
        "peak_rss_growth_mb": peak_rss_mb() - rss_before,
        "param_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
    }
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def _per_stage(ranks: list[dict[str, Any]], key: str) -> str:
    return " / ".join(f"{r[key]:.0f}" for r in ranks)


def launch(schedule: str, stages: int, timeout_s: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=str(find_free_network_port()), WORLD_SIZE=str(stages))
        command = [sys.executable, __file__, "--worker", schedule, "--stages", str(stages), "--out", tmp]
        procs = []
        for rank in range(stages):
            with open(out / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        command, env={**env, "RANK": str(rank)}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
                    )
                )
        wait_all(procs, [out / f"rank{r}.log" for r in range(stages)], timeout_s, f"{schedule} P={stages}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(stages)]
        return sorted(ranks, key=lambda r: r["stage"])  # in pipeline order (rank 0 runs the last stage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.stages[0], Path(args.out))
        return
    cfg = CONFIG
    print(
        f"GPT layers={cfg.layers} dim={cfg.dim} block={cfg.block_size}; batch {cfg.batch_size} = "
        f"{cfg.num_microbatches} micro-batches of {cfg.micro_batch_size}; 1 thread per process, gloo\n"
    )
    rows = []
    for stages in args.stages:
        for schedule in SCHEDULES:
            ranks = launch(schedule, stages, args.timeout)
            rows.append({"stages": stages, "schedule": schedule, "per_stage": ranks})
            print(
                f"P={stages} {schedule:<7} step ms {_per_stage(ranks, 'step_ms')} | saved MB "
                f"{_per_stage(ranks, 'saved_mb')} | peak RSS MB {_per_stage(ranks, 'peak_rss_growth_mb')}",
                flush=True,
            )
    print("\n| P | schedule | step ms (slowest stage) | saved MB per stage | peak RSS MB per stage |")
    print("|---:|---|---:|---|---|")
    for row in rows:
        ranks = row["per_stage"]
        print(
            f"| {row['stages']} | {row['schedule']} | {max(r['step_ms'] for r in ranks):.0f} | "
            f"{_per_stage(ranks, 'saved_mb')} | {_per_stage(ranks, 'peak_rss_growth_mb')} |"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"config": asdict(cfg), "results": rows}, indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
