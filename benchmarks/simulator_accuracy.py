"""How well the simulator predicts real step times, and whether AutoConfig picks the fastest configuration.

Run from the repository root (about 16 minutes on 2 CPU cores)::

    python benchmarks/simulator_accuracy.py

1. Profiles examples/gpt.py's GPT (8 layers, dim 128, block 64) with ``lightning-varuna profile`` (micro-batch sizes
   1, 2, 4, 8; communication with 2 to 4 processes; a few training steps with 1 to 4 processes, which calibrate it)
   into ``benchmarks/results/gpt.profile.json``: "the profile alone" below.
2. Trains it with ``Trainer.fit`` + ``VarunaStrategy(profile=...)`` (so the stages are cut where the simulator cuts
   them) for every configuration in ``CONFIGS`` on a global batch of 16, in fresh processes, and takes the median
   step time (``on_train_batch_start`` -> ``on_train_batch_end`` on rank 0) after a warm-up. Before each run it
   waits for other processes to leave the CPUs idle.
   The runs of 3. and 2. alternate, so a drift of this VM's speed touches both alike; ``--repeats N`` runs them all
   N times in turn, and each configuration's step is the median of its runs (its calibration, the median traced step
   of all of them).
3. Calibrates the profile (``lightning_varuna.profiling.calibration``) with the measured timelines (5 steps; the
   median counts) of two more configurations per process count (four for 2 processes) and one with replicas for 2
   and 4 processes (``CALIBRATION``, none of them among ``CONFIGS``). ``--only schedules`` calibrates with
   ``SCHEDULE_CALIBRATION`` (2 processes: GPipe and 1F1B at 1 to 8 rows, the new schedules at 1 and 8) and evaluates
   ``SCHEDULE_CONFIGS`` (the new schedules at 2 and 4 rows); about 18 minutes with ``--repeats 3``.
4. Prints measured against predicted step time per configuration, from the profile alone and calibrated, the median
   absolute errors, and where AutoConfig's pick among the measured configurations ranks.
5. Spilled rows, side by side: trains the same GPT on one device with ``SpillingStrategy`` on the host and the disk
   tier at the budgets of ``SPILLED`` (set from the profile's own packing: the smallest budget that fetches every
   shard ahead, and larger ones), one batch of 16 a step, and compares with ``simulate_spilled`` (the spill tiers'
   times measured by the profile), from the profile alone and with each tier's compute factor calibrated by one
   held-out configuration (``SPILLED_CALIBRATION``). ``--only spilled`` runs these rows alone: it profiles the
   segments at 8 and 16 rows and the spill tiers into ``benchmarks/results/gpt.spilled.profile.json`` first (kept
   with ``--reuse-profile``).

Writes ``benchmarks/results/simulator_accuracy.json`` and, per configuration, the predicted and the measured
(``PipelineTrace``) timeline of a step to ``benchmarks/results/traces/`` (open them in https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_varuna.profiling.profile import ModelProfile
    from lightning_varuna.profiling.trace import Span

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results"
TRACES = RESULTS / "traces"
PROFILE = RESULTS / "gpt.profile.json"
MODEL = dict(vocab_size=65, block_size=64, dim=128, layers=8, heads=4)
GLOBAL_BATCH = 16
# (P, D, micro-batch size, schedule)
CONFIGS = [
    (1, 1, 4, "1f1b"),
    (1, 2, 8, "1f1b"),
    (2, 1, 4, "1f1b"),
    (2, 1, 2, "gpipe"),
    (2, 1, 4, "varuna"),
    (4, 1, 2, "1f1b"),
    (4, 1, 4, "varuna"),
    (2, 2, 4, "gpipe"),
    (2, 2, 2, "varuna"),
    (1, 4, 4, "1f1b"),
]
# The schedules of issue 44 (schedule, stages per rank), on 2 processes (P, D, micro-batch size, schedule, stages per
# rank): measured at 4 and 2 rows with ``--only schedules`` (the calibration's runs and these) and reported apart,
# under "schedules".
NEW_SCHEDULES = [("zero-bubble", 1), ("interleaved-1f1b", 2), ("zbv", 2)]
SCHEDULE_CONFIGS = [(2, 1, mb, schedule, V) for schedule, V in NEW_SCHEDULES for mb in (4, 2)]
# Two micro-batch sizes per process count (1, 2, 4; four for 2 processes, where most evaluated configurations are)
# and replicas for 2 and 4 processes, held out from CONFIGS: their measured steps calibrate the profile.
CALIBRATION = [
    (1, 1, 8, "gpipe"),
    (1, 1, 1, "gpipe"),
    (2, 1, 8, "gpipe"),
    (2, 1, 4, "gpipe"),
    (2, 1, 2, "1f1b"),
    (2, 1, 1, "1f1b"),
    (4, 1, 4, "1f1b"),
    (4, 1, 1, "gpipe"),
    (1, 2, 4, "gpipe"),
    (1, 4, 2, "gpipe"),
    (2, 2, 8, "1f1b"),
]
# Held out from SCHEDULE_CONFIGS: with ``--only schedules`` these runs calibrate, all on 2 processes (as many as every
# schedule configuration has): GPipe and 1F1B at every size, and the new schedules at the sizes SCHEDULE_CONFIGS
# does not use. Those teach how much longer than profiled a deferred weight pass takes; all add to the costs per action.
SCHEDULE_CALIBRATION = [(2, 1, mb, schedule, 1) for mb in (8, 4, 2, 1) for schedule in ("gpipe", "1f1b")] + [
    (2, 1, mb, schedule, V) for schedule, V in NEW_SCHEDULES for mb in (8, 1)
]
CALIBRATED_PROFILE = RESULTS / "gpt.calibrated.profile.json"
SPILLED_PROFILE = RESULTS / "gpt.spilled.profile.json"
# (tier, budget): a budget is a multiple of the smallest that fetches every shard ahead for the profile's packing
# (at 4x the GPT fits whole, and SpillingStrategy runs it whole: nothing spilled to compare).
SPILLED = [("host", 1.0), ("disk", 1.0), ("host", 1.5), ("disk", 1.5), ("host", 3.0), ("disk", 3.0)]
# One held-out spilled configuration per tier: its measured step calibrates the tier's compute factor.
SPILLED_CALIBRATION = [("host", 2.0), ("disk", 2.0)]
_STEPS_APART = 10_000  # the steps of a configuration's repeats, told apart in its traces


def worker(config: list, out: str, warmup: int, steps: int) -> None:
    """One configuration in Lightning's own processes (Trainer(devices=P*D) starts the other ranks)."""
    import lightning as L
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataset, make_text
    from pipeline_step import StepTimer

    from lightning_varuna import PipelineTrace, VarunaStrategy

    P, D, mb, schedule, V = _unpacked(config)
    L.seed_everything(0, verbose=False)
    data = CharDataset(make_text(), block_size=MODEL["block_size"])
    model = GPT(**MODEL)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=P * D,
        strategy=VarunaStrategy(
            pipeline_parallel_size=P, micro_batch_size=mb, schedule=schedule, stages_per_rank=V, profile=str(PROFILE)
        ),
        max_steps=warmup + steps,
        callbacks=[timer, PipelineTrace(str(TRACES / f"{_name(config)}.measured.json"), step=warmup, steps=5)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // D, shuffle=True))
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps({"step_s": timer.step_s[warmup:]}))


def spilled_worker(config: list, out: str, warmup: int, steps: int) -> None:
    """One spilled configuration: ``Trainer(devices=1, strategy=SpillingStrategy(...))``, timing each step from its
    batch's start to its end (a timer without ``on_before_optimizer_step``: each shard steps in its backward)."""
    import lightning as L
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataset, make_text

    from lightning_varuna import SpillingStrategy

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.step_s: list[float] = []

        def on_train_batch_start(self, *args: object) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, *args: object) -> None:
            self.step_s.append(time.perf_counter() - self._start)

    tier, budget = config
    L.seed_everything(0, verbose=False)
    data = CharDataset(make_text(), block_size=MODEL["block_size"])
    timer = Timer()
    with tempfile.TemporaryDirectory(prefix="spill-") as spill_dir:
        strategy = SpillingStrategy(memory_budget=budget, spill_dir=spill_dir if tier == "disk" else None)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_steps=warmup + steps,
            callbacks=[timer],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(GPT(**MODEL), DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True))
    Path(out).write_text(json.dumps({"step_s": timer.step_s[warmup:], "shards": strategy.shards}))


def measure_spilled(config: tuple, warmup: int, steps: int, quiet_wait: float) -> tuple[float, list[list[int]]]:
    """Median step time of a spilled ``config`` and the shards the strategy packed."""
    result = _run_worker("--spilled-worker", config, warmup, steps, quiet_wait)
    return statistics.median(result["step_s"]), result["shards"]


def spilled_rows(profile: ModelProfile, warmup: int, steps: int, quiet_wait: float) -> list[dict]:
    """Measure the configurations of ``SPILLED_CALIBRATION`` and calibrate each tier's compute factor with them, then
    measure and predict those of ``SPILLED``; print a row each."""
    from lightning_varuna.partition.packing import smallest_budgets
    from lightning_varuna.profiling.calibration import calibrate_spilled
    from lightning_varuna.profiling.spilled import SpilledConfig, segment_memory, simulate_spilled

    _, with_prefetch, _ = smallest_budgets(*segment_memory(profile, GLOBAL_BATCH))
    measured = {}
    for tier, factor in SPILLED_CALIBRATION + SPILLED:
        config = SpilledConfig(GLOBAL_BATCH, int(with_prefetch * factor), tier)
        measured[tier, factor] = (config, *measure_spilled((tier, config.memory_budget), warmup, steps, quiet_wait))
    calibrated = calibrate_spilled(profile, [measured[key][:2] for key in SPILLED_CALIBRATION])
    print(
        "calibrated with " + ", ".join(f"{t} {f:g}x" for t, f in SPILLED_CALIBRATION) + ": compute factor "
        + ", ".join(f"{t} {c.compute_factor:.2f}" for t, c in sorted(calibrated.spill.items()))
    )  # fmt: skip
    rows = []
    for tier, factor in SPILLED:
        config, step_s, shards = measured[tier, factor]
        prediction = simulate_spilled(profile, config)
        calibrated_prediction = simulate_spilled(calibrated, config, timeline=True)
        name = f"spilled-{tier}-{factor:g}x"
        (TRACES / f"{name}.predicted.json").write_text(calibrated_prediction.chrome_trace())
        row = dict(config=[tier, config.memory_budget], measured_ms=step_s * 1e3, measured_shards=shards)
        row["predicted_shards"] = prediction.shards
        row["recomputed"] = prediction.recomputed
        for key, predicted in (("", prediction.step_s), ("calibrated_", calibrated_prediction.step_s)):
            row[f"{key}predicted_ms"] = predicted * 1e3
            row[f"{key}error"] = (predicted - step_s) / step_s
        rows.append(row)
        same = "same shards" if shards == prediction.shards else f"shards {shards} vs predicted {prediction.shards}"
        print(
            f"{tier + ' ' + f'{config.memory_budget / 2**20:.1f} MiB':<24} {step_s * 1e3:>12.1f} "
            f"{row['predicted_ms']:>11.1f} {row['error']:>+7.1%} {row['calibrated_predicted_ms']:>14.1f} "
            f"{row['calibrated_error']:>+7.1%}  {len(shards)} shards, {len(prediction.recomputed)} recompute ({same})",
            flush=True,
        )
    return rows


def measure(config: tuple, warmup: int, steps: int) -> float:
    """Median step time of ``config``, started once other processes leave the CPUs idle."""
    return statistics.median(_run_worker("--worker", config, warmup, steps, 60.0)["step_s"])


def _run_worker(flag: str, config: tuple, warmup: int, steps: int, quiet_wait: float) -> dict:
    """What this script run as the worker ``flag`` wrote for ``config``, started once other processes leave the CPUs
    idle (waiting at most ``quiet_wait`` seconds)."""
    from pipeline_step import wait_until_quiet

    wait_until_quiet(quiet_wait)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        command = [sys.executable, __file__, flag, json.dumps(config), "--out", str(out)]
        command += ["--warmup", str(warmup), "--steps", str(steps)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=_env())
        if done.returncode != 0:
            raise RuntimeError(f"{config} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def _unpacked(config: tuple | list) -> tuple[int, int, int, str, int]:
    """(P, D, micro-batch size, schedule, stages per rank: 1 unless given)."""
    P, D, mb, schedule, *V = config
    return P, D, mb, schedule, V[0] if V else 1


def _name(config: tuple | list) -> str:
    P, D, mb, schedule, V = _unpacked(config)
    return f"P{P}-D{D}-mb{mb}-{schedule}" + (f"-V{V}" if V > 1 else "")


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONWARNINGS": "ignore"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reuse-profile", action="store_true", help="keep an existing profile")
    parser.add_argument(
        "--repeats", type=int, default=1, help="measure every configuration this many times, in turn (the median)"
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=60.0, help="seconds to wait at most for idle CPUs before each run"
    )
    parser.add_argument(
        "--only",
        choices=("pipeline", "spilled", "schedules"),
        help="run only these rows (spilled: with the profiles written; schedules: SCHEDULE_CONFIGS)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spilled-worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.out, args.warmup, args.steps)
        return
    if args.spilled_worker:
        spilled_worker(json.loads(args.spilled_worker), args.out, args.warmup, args.steps)
        return

    from pipeline_step import wait_until_quiet

    from lightning_varuna.profiling.autoconfig import candidate_configs, rank_configs
    from lightning_varuna.profiling.calibration import calibrate
    from lightning_varuna.profiling.profile import ModelProfile
    from lightning_varuna.profiling.simulator import Config, simulate
    from lightning_varuna.profiling.trace import read_chrome_trace

    header = f"{'config':<24} {'measured ms':>12} {'profile ms':>11} {'error':>7} {'calibrated ms':>14} {'error':>7}"
    if args.only == "spilled":
        if not (args.reuse_profile and SPILLED_PROFILE.exists()):
            wait_until_quiet(args.quiet_wait)
            _profile(SPILLED_PROFILE, ["8", "16"], devices=1)
        print(header)
        rows = spilled_rows(ModelProfile.load(str(SPILLED_PROFILE)), args.warmup, args.steps, args.quiet_wait)
        _write_results({"spilled": _spilled_results(rows)})
        return
    if not (args.reuse_profile and PROFILE.exists()):
        _profile(PROFILE, ["1", "2", "4", "8", "16"], devices=4)
    profile = ModelProfile.load(str(PROFILE))
    _add_spill_times(profile)
    TRACES.mkdir(parents=True, exist_ok=True)
    measure(CONFIGS[0], args.warmup, args.steps)  # discarded: the first run after start is slower on this VM
    configs = SCHEDULE_CONFIGS if args.only == "schedules" else CONFIGS
    calibration = SCHEDULE_CALIBRATION if args.only == "schedules" else CALIBRATION
    runs: dict[tuple, list[float]] = {}
    traced: dict[tuple, tuple[Config, list[Span]]] = {}  # of the calibration's configurations: every repeat's steps
    for repeat in range(args.repeats):
        for config in (c for pair in zip_longest(calibration, configs) for c in pair if c):
            runs.setdefault(config, []).append(measure(config, args.warmup, args.steps))
            print(f"measured {_name(config)}: {runs[config][-1] * 1e3:.1f} ms", flush=True)
            if config in calibration:
                spans, metadata = read_chrome_trace((TRACES / f"{_name(config)}.measured.json").read_text())
                _, steps = traced.setdefault(config, (Config(**metadata["config"]), []))
                steps += [replace(span, step=repeat * _STEPS_APART + span.step) for span in spans]
    step_s = {config: statistics.median(times) for config, times in runs.items()}
    measured = [traced[config] for config in calibration]
    calibrated = calibrate(profile, measured)
    calibrated.save(str(CALIBRATED_PROFILE))
    print("calibrated with " + ", ".join(map(_name, calibration)) + ":", flush=True)
    for processes, overheads in sorted(calibrated.overheads.items()):
        print(f"  {processes} process(es): {overheads}")
    rows = []
    print(header)
    for config in configs:
        P, D, mb, schedule, V = _unpacked(config)
        prediction = simulate(profile, Config(P, D, mb, schedule, GLOBAL_BATCH, stages_per_rank=V))
        calibrated_prediction = simulate(
            calibrated, Config(P, D, mb, schedule, GLOBAL_BATCH, stages_per_rank=V), timeline=True
        )
        (TRACES / f"{_name(config)}.predicted.json").write_text(calibrated_prediction.chrome_trace())
        measured = step_s[config]
        row = dict(config=list(config), measured_ms=measured * 1e3, runs_ms=[t * 1e3 for t in runs[config]])
        for key, predicted in (("", prediction.step_s), ("calibrated_", calibrated_prediction.step_s)):
            row[f"{key}predicted_ms"] = predicted * 1e3
            row[f"{key}error"] = (predicted - measured) / measured
        rows.append(row)
        name = f"P={P} D={D} mb={mb} {schedule}" + (f" V={V}" if V > 1 else "")
        print(
            f"{name:<24} {measured * 1e3:>12.1f} {row['predicted_ms']:>11.1f} {row['error']:>+7.1%} "
            f"{row['calibrated_predicted_ms']:>14.1f} {row['calibrated_error']:>+7.1%}   runs: "
            + " ".join(f"{t:.1f}" for t in row["runs_ms"]),
            flush=True,
        )
    median_error = statistics.median(abs(r["error"]) for r in rows)
    calibrated_median_error = statistics.median(abs(r["calibrated_error"]) for r in rows)
    if args.only == "schedules":
        print(f"\nmedian absolute error: {median_error:.1%} from the profile alone, {calibrated_median_error:.1%} "
              "calibrated")  # fmt: skip
        _write_results({"schedules": dict(rows=rows, median_abs_error=median_error,
                                          calibrated_median_abs_error=calibrated_median_error,
                                          calibration=[list(c) for c in calibration],
                                          weight_factor=calibrated.overheads[2].weight_factor)})  # fmt: skip
        return
    spilled = [] if args.only == "pipeline" else spilled_rows(profile, args.warmup, args.steps, args.quiet_wait)
    by_world: dict[int, list[dict]] = {}
    for row in rows:
        by_world.setdefault(row["config"][0] * row["config"][1], []).append(row)
    picks = []
    for world, measured_rows in sorted(by_world.items()):
        if len(measured_rows) < 2:
            continue
        ranked = rank_configs(calibrated, world, GLOBAL_BATCH)
        among = {tuple(r["config"]) for r in measured_rows}
        pick = next(p.config for p in ranked if (p.config.pipeline_parallel_size, p.config.data_parallel_size,
                                                   p.config.micro_batch_size, p.config.schedule) in among)  # fmt: skip
        key = [pick.pipeline_parallel_size, pick.data_parallel_size, pick.micro_batch_size, pick.schedule]
        fastest = min(measured_rows, key=lambda r: r["measured_ms"])
        picked = next(r for r in measured_rows if r["config"] == key)
        picks.append(
            dict(
                devices=world,
                pick=key,
                measured_fastest=fastest["config"],
                pick_vs_fastest=picked["measured_ms"] / fastest["measured_ms"],
            )
        )
        print(
            f"{world} devices: AutoConfig picks {key} ({picked['measured_ms']:.1f} ms measured); the measured fastest "
            f"is {fastest['config']} ({fastest['measured_ms']:.1f} ms): {picks[-1]['pick_vs_fastest']:.2f}x"
        )
    print(
        f"\nmedian absolute error over {len(rows)} configurations: {median_error:.1%} from the profile alone, "
        f"{calibrated_median_error:.1%} calibrated"
    )
    candidates = candidate_configs(profile, 4, GLOBAL_BATCH)
    start = time.perf_counter()
    for config in candidates:
        simulate(profile, config)
    per_second = len(candidates) / (time.perf_counter() - start)
    print(f"simulator speed: {per_second:.0f} configurations per second ({len(candidates)} candidates for 4 devices)")
    results = {
        "global_batch": GLOBAL_BATCH,
        "model": MODEL,
        "rows": rows,
        "median_abs_error": median_error,
        "calibration": [list(c) for c in CALIBRATION],
        "calibrated_median_abs_error": calibrated_median_error,
        "autoconfig": picks,
        "simulated_configs_per_s": per_second,
    }
    _write_results({**results, "spilled": _spilled_results(spilled)} if spilled else results)


def _profile(path: Path, micro_batch_sizes: list[str], devices: int) -> None:
    subprocess.run(
        [
            sys.executable, "-m", "lightning_varuna.cli", "profile", "examples/gpt.py:GPT", "--init-args",
            json.dumps(MODEL), "--input-shape", f"8x{MODEL['block_size']}", "--input-dtype", "int64",
            "--micro-batch-sizes", *micro_batch_sizes, "--devices", str(devices), "--output", str(path),
        ],
        cwd=ROOT,
        check=True,
    )  # fmt: skip


def _add_spill_times(profile: object) -> None:
    """Time the spill tiers into a profile written before the profiler measured them (``--reuse-profile``)."""
    import torch

    from lightning_varuna.spilling.bandwidth import measure_spill_tiers

    if not profile.spill:  # type: ignore[attr-defined]
        profile.spill = measure_spill_tiers(torch.device("cpu"))  # type: ignore[attr-defined]
        profile.save(str(PROFILE))  # type: ignore[attr-defined]


def _spilled_results(rows: list[dict]) -> dict:
    """The spilled rows and their median absolute errors (printed)."""
    median_error = statistics.median(abs(r["error"]) for r in rows)
    calibrated_median_error = statistics.median(abs(r["calibrated_error"]) for r in rows)
    by_tier = {
        tier: statistics.median(abs(r["calibrated_error"]) for r in rows if r["config"][0] == tier)
        for tier in sorted({r["config"][0] for r in rows})
    }
    print(
        f"spilled: median absolute error over {len(rows)} configurations: {median_error:.1%} from the profile alone, "
        f"{calibrated_median_error:.1%} calibrated ("
        + ", ".join(f"{tier} {error:.1%}" for tier, error in by_tier.items())
        + ")"
    )
    return dict(rows=rows, median_abs_error=median_error, calibrated_median_abs_error=calibrated_median_error)


def _write_results(results: dict) -> None:
    """Update ``simulator_accuracy.json`` with ``results`` (the rows a run did not measure are kept)."""
    path = RESULTS / "simulator_accuracy.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    previous = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**previous, **results}, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
