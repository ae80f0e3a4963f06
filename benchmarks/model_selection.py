"""One Optuna study run several ways on D CPU devices, side by side: as Optuna users parallelize it, as a task queue
would, and with `MultiModelTrainer.optimize`.

Run from the repository root (about 3 minutes on 2 CPU cores)::

    python benchmarks/model_selection.py

The study: ``--trials`` trials (16) of `lightning_varuna.demos.MLP` regressors of unequal sizes and lengths (width
512 or 1024, 2 to 6 layers, 40 to 160 steps, the learning rate), drawn once by a seeded `RandomSampler` and enqueued
in every way's study (trial n is the same model in every way and run), pruned by `SuccessiveHalvingPruner` on
``val_loss`` reported every 10 steps, minimized. A device is one core (one torch thread). The ways, each in fresh
processes against its own journal file:

* ``optuna-workers``: D worker processes, each ``study.optimize(objective)`` with a plain Lightning Trainer (as
  Optuna's documentation parallelizes a study), until the study holds the trials;
* ``task-queue``: one process, ``study.optimize(objective, n_jobs=D)``: D threads each taking the next trial, one
  trial per device as a task queue runs them;
* ``sweep``: ``MultiModelTrainer(devices=D).optimize(study, build, ...)``: as it runs by default, D trials at once;
* ``sweep-processes``: the same with ``processes=True``: a worker of the study in each of D processes;
* ``sweep-2x``: the same with ``max_running=2D``: 2D trials at once, their steps taking turns on the D devices,
  longest remaining time (to the trial's end) first;
* ``sweep-expected``: ``max_running=2D`` and ``ranking="expected"``: longest expected remaining time first (the time
  to a trial's next rung, plus a third of the rest, since the pruner promotes one trial in three).

``--ways`` runs some of them only (e.g. ``--ways sweep sweep-2x sweep-expected``). ``--pruner none`` runs the study
unpruned: every way then trains the same steps of the same trials, where with a pruner the order in which trials
report changes which ones it stops.

``--rounds N`` runs every way N times, the ways in turn, and shows each way's run of the median makespan (every
run's makespan beside it): on a shared machine one run's makespan moves by several percent.

``--accelerator gpu --devices 1`` runs the same study on one GPU (the trials' Trainers and the sweep on
``accelerator="gpu"``); the busy column is then the GPU's, sampled from NVML's utilization (the share of time a kernel
ran) while each way runs.

For each: the makespan (from the first of its processes being ready, its imports done, to the last one's end, the
ends of its fits included), trials complete and pruned, the best value and when it was found, and the devices' busy
time; against the lower bound max(Σ tᵢ / D, max tᵢ), tᵢ being trial i trained alone with plain Lightning for the
steps it actually ran (measured after the ways ran, each distinct (model, steps) once, all in one process after a
warm-up fit: a process's first fit pays one-off costs that every way pays once, not once a trial). Writes
``benchmarks/results/model_selection.json`` (``_unpruned``, ``_gpu`` added to the name for ``--pruner none`` and on
a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import optuna
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import MultiModelTrainer
from lightning_varuna.demos import MLP
from lightning_varuna.multimodel.scheduler import Ranking

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "model_selection.json"
WAYS = ["optuna-workers", "task-queue", "sweep", "sweep-processes", "sweep-2x", "sweep-expected"]
BATCH, VAL_EVERY = 64, 10
QUIET: dict[str, Any] = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
VALIDATION: dict[str, Any] = {
    "val_check_interval": VAL_EVERY,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
}


def suggest(trial: optuna.trial.Trial) -> tuple[int, int, int, float]:
    """A trial's model and length: (width, layers, steps, lr)."""
    width = trial.suggest_categorical("width", [512, 1024])
    layers = trial.suggest_int("layers", 2, 6)
    steps = trial.suggest_categorical("steps", [40, 80, 120, 160])
    lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    return width, layers, steps, lr


def model_and_loaders(width: int, layers: int, lr: float) -> tuple[MLP, DataLoader, DataLoader]:
    torch.manual_seed(layers)
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(BATCH * 20, width, generator=generator)
    data = TensorDataset(x, torch.tanh(x.roll(1, 1)))
    return MLP(width, layers, lr=lr), DataLoader(data, batch_size=BATCH), DataLoader(data, batch_size=256)


def trial_parameters(trials: int) -> list[dict[str, Any]]:
    """The parameters of the study's trials, drawn once by a seeded `RandomSampler`: every way enqueues them, so that
    trial n is the same model in all of them (D workers, each with its own seeded sampler, would otherwise draw the
    same parameters twice, and threads sharing one would draw them in a different order every run)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = []
    for _ in range(trials):
        trial = study.ask()
        suggest(trial)
        drawn.append(trial.params)
        study.tell(trial, 0.0)
    return drawn


PRUNERS = ["successive-halving", "none"]


def open_study(folder: Path) -> optuna.Study:
    """The way's study in ``folder``, pruned as ``folder / "pruner"`` names (one of `PRUNERS`)."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.log")))
    pruner: optuna.pruners.BasePruner = optuna.pruners.NopPruner()
    if (folder / "pruner").read_text() == "successive-halving":
        pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=VAL_EVERY, reduction_factor=3)
    return optuna.create_study(
        study_name="select", storage=storage, load_if_exists=True, direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=0), pruner=pruner,
    )  # fmt: skip


class Reports(L.Callback):
    """What an Optuna user's objective does in a plain Trainer: report ``val_loss``, stop when pruned."""

    def __init__(self, trial: optuna.trial.Trial) -> None:
        self.trial, self.pruned = trial, False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        self.trial.report(float(trainer.callback_metrics["val_loss"]), trainer.global_step)
        if self.trial.should_prune():
            self.pruned, trainer.should_stop = True, True


def objective(trial: optuna.trial.Trial, accelerator: str) -> float:
    width, layers, steps, lr = suggest(trial)
    model, train, val = model_and_loaders(width, layers, lr)
    reports = Reports(trial)
    trial.set_user_attr("start", time.time())
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, max_steps=steps, callbacks=[reports], enable_model_summary=False,
        **VALIDATION, **QUIET,
    )  # fmt: skip
    trainer.fit(model, train, val)
    trial.set_user_attr("end", time.time())
    trial.set_user_attr("steps_ran", trainer.global_step)
    if reports.pruned:
        raise optuna.TrialPruned
    return float(trainer.callback_metrics["val_loss"])


def run_optuna_worker(folder: Path, trials: int, accelerator: str) -> None:
    torch.set_num_threads(1)
    study = open_study(folder)
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.RUNNING)
    limit = optuna.study.MaxTrialsCallback(trials, states=states)
    study.optimize(functools.partial(objective, accelerator=accelerator), callbacks=[limit])


def run_task_queue(folder: Path, trials: int, devices: int, accelerator: str) -> None:
    torch.set_num_threads(1)
    open_study(folder).optimize(functools.partial(objective, accelerator=accelerator), n_trials=trials, n_jobs=devices)


def run_sweep(
    folder: Path,
    trials: int,
    devices: int,
    ranking: Ranking,
    max_running: int | None,
    processes: bool,
    accelerator: str,
) -> None:
    study = open_study(folder)

    class Times(L.Callback):
        def __init__(self, trial: optuna.trial.Trial) -> None:
            self.trial = trial

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.trial.set_user_attr("start", time.time())

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.trial.set_user_attr("end", time.time())
            self.trial.set_user_attr("steps_ran", trainer.global_step)

    def build(trial: optuna.trial.Trial) -> dict[str, Any]:
        width, layers, steps, lr = suggest(trial)
        model, train, val = model_and_loaders(width, layers, lr)
        return dict(
            model=model, train_dataloaders=train, val_dataloaders=val, max_steps=steps, callbacks=[Times(trial)],
            **VALIDATION, **QUIET,
        )  # fmt: skip

    sweep = MultiModelTrainer(
        accelerator=accelerator,
        devices=devices,
        checkpoint_dir=str(folder / "checkpoints"),
        enable_progress_bar=False,
        ranking=ranking,
        processes=processes,
    )
    sweep.optimize(study, build, n_trials=trials, monitor="val_loss", max_running=max_running)
    busy = sum(span.end_s - span.start_s for span in sweep.spans)
    (folder / "busy.json").write_text(json.dumps({"busy_s": busy}))


def run_worker(way: str, folder: Path, trials: int, devices: int, accelerator: str) -> None:
    """One process of the way ``way``."""
    if way == "optuna-workers":
        run_optuna_worker(folder, trials, accelerator)
    elif way == "task-queue":
        run_task_queue(folder, trials, devices, accelerator)
    else:
        ranking: Ranking = "expected" if way == "sweep-expected" else "end"
        max_running = None if way in ("sweep", "sweep-processes") else 2 * devices
        run_sweep(folder, trials, devices, ranking, max_running, way == "sweep-processes", accelerator)


def run_way(way: str, folder: Path, trials: int, devices: int, accelerator: str) -> None:
    """Run the study the way ``way``, in fresh processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, __file__, "--worker", way, "--folder", str(folder), f"--trials={trials}"]
    command += [f"--devices={devices}", f"--accelerator={accelerator}"]
    workers = devices if way == "optuna-workers" else 1
    processes = [subprocess.Popen(command, env=env, cwd=ROOT) for _ in range(workers)]
    for process in processes:
        if process.wait():
            raise RuntimeError(f"{way} failed")


@contextmanager
def gpu_utilization(samples: list[tuple[float, int]]) -> Iterator[None]:
    """Append (time, NVML's GPU utilization in %) to ``samples`` every 50 ms while the block runs."""
    import pynvml  # nvidia-ml-py, which comes with CUDA's torch wheels

    pynvml.nvmlInit()
    handle, done = pynvml.nvmlDeviceGetHandleByIndex(0), threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            samples.append((time.time(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        pynvml.nvmlShutdown()


def alone_s(keys: list[tuple[int, int, int, float]], accelerator: str) -> list[float]:
    """The wall time of training each model alone, plain Lightning, one thread, for its ``steps`` (validating as in
    the study), after a warm-up fit."""
    torch.set_num_threads(1)

    def fit(width: int, layers: int, steps: int, lr: float) -> float:
        model, train, val = model_and_loaders(width, layers, lr)
        trainer = L.Trainer(
            accelerator=accelerator, devices=1, max_steps=steps, enable_model_summary=False, **VALIDATION, **QUIET,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(model, train, val)
        return time.perf_counter() - start

    fit(*keys[0])  # warm: a process's first fit pays one-off costs that a way pays once, not once a trial
    return [fit(*key) for key in keys]


def measure_alone(keys: list[tuple], accelerator: str) -> dict[tuple, float]:
    """`alone_s` of each key, all in one fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, __file__, "--alone", json.dumps(keys), f"--accelerator={accelerator}"]
    times = json.loads(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)
    return dict(zip(keys, times))


def summarize(
    way: str, folder: Path, devices: int, alone: dict[tuple, float], gpu_samples: list[tuple[float, int]]
) -> dict[str, Any]:
    study = open_study(folder)
    trials = [t for t in study.trials if "end" in t.user_attrs]
    spans = [json.loads(path.read_text()) for path in folder.glob("span-*.json")]
    start, end = min(span["ready"] for span in spans), max(span["done"] for span in spans)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = min(complete, key=lambda t: t.value)  # type: ignore[arg-type, return-value]
    times = [alone[_key(t)] for t in trials]
    bound = max(sum(times) / devices, max(times))
    during = [utilization for at, utilization in gpu_samples if start <= at <= end]
    if during:  # GPU 0's utilization over the makespan
        busy = sum(during) / 100 / len(during) * devices * (end - start)
    elif way.startswith("sweep") and way != "sweep-processes":  # its devices' turns
        busy = json.loads((folder / "busy.json").read_text())["busy_s"]
    else:  # a trial holds its device (its process's) from its start to its end
        busy = sum(t.user_attrs["end"] - t.user_attrs["start"] for t in trials)
    makespan = end - start
    return {
        "way": way,
        "makespan_s": makespan,
        "bound_s": bound,
        "vs_bound": makespan / bound,
        "complete": len(complete),
        "pruned": sum(t.state == optuna.trial.TrialState.PRUNED for t in trials),
        "best_value": best.value,
        "best_found_s": best.user_attrs["end"] - start,
        "busy_share": busy / (devices * makespan),
        "steps_ran": sum(t.user_attrs["steps_ran"] for t in trials),
    }


def _key(trial: optuna.trial.FrozenTrial) -> tuple:
    p = trial.params
    return p["width"], p["layers"], trial.user_attrs["steps_ran"], p["lr"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=WAYS, help="the ways to run (default: all)")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every way, in turn; the median makespan's shown")
    parser.add_argument(
        "--pruner", choices=PRUNERS, default=PRUNERS[0], help="none: every way runs the same steps of the same trials"
    )
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--alone", help=argparse.SUPPRESS)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.worker:
        ready = time.time()
        run_worker(args.worker, Path(args.folder), args.trials, args.devices, args.accelerator)
        span = {"ready": ready, "done": time.time()}
        (Path(args.folder) / f"span-{os.getpid()}.json").write_text(json.dumps(span))
        return None
    if args.alone:
        print(json.dumps(alone_s([tuple(key) for key in json.loads(args.alone)], args.accelerator)))
        return None
    print(
        f"torch {torch.__version__}, lightning {L.__version__}, optuna {optuna.__version__}, {os.cpu_count()} CPUs; "
        f"{args.trials} trials on {args.devices} {args.accelerator} devices"
        + (f" ({torch.cuda.get_device_name()})" if args.accelerator == "gpu" else ""),
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(way, n) for n in range(args.rounds) for way in args.ways]  # the ways in turn, round after round
        folders = {run: Path(tmp) / f"{run[0]}-{run[1]}" for run in runs}
        gpu_samples: dict[tuple[str, int], list[tuple[float, int]]] = {run: [] for run in runs}
        parameters = trial_parameters(args.trials)
        for (way, n), folder in folders.items():
            folder.mkdir()
            (folder / "pruner").write_text(args.pruner)
            study = open_study(folder)
            for params in parameters:
                study.enqueue_trial(params)
            started = time.perf_counter()
            with gpu_utilization(gpu_samples[way, n]) if args.accelerator == "gpu" else nullcontext():
                run_way(way, folder, args.trials, args.devices, args.accelerator)
            print(f"  round {n + 1}: {way:<16} {time.perf_counter() - started:6.1f} s", flush=True)
        keys = {_key(t) for folder in folders.values() for t in open_study(folder).trials if "end" in t.user_attrs}
        alone = measure_alone(sorted(keys), args.accelerator)
        runs_of = {way: [summarize(way, folders[way, n], args.devices, alone, gpu_samples[way, n]) for n in
                         range(args.rounds)] for way in args.ways}  # fmt: skip
    rows = []
    for way_runs in runs_of.values():  # each way's run of the median makespan, with every run's makespan
        median = sorted(way_runs, key=lambda r: r["makespan_s"])[(len(way_runs) - 1) // 2]
        rows.append({**median, "makespans_s": [r["makespan_s"] for r in way_runs]})
    print("\n| way | makespan s | bound s | vs bound | complete | pruned | steps | best val_loss | found at s | busy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['way']} | {r['makespan_s']:.1f} | {r['bound_s']:.1f} | {r['vs_bound']:.2f}x | {r['complete']} "
            f"| {r['pruned']} | {r['steps_ran']} | {r['best_value']:.4f} | {r['best_found_s']:.1f} "
            f"| {r['busy_share']:.0%} |"
        )
    if args.rounds > 1:
        for r in rows:
            print(f"  {r['way']:<16} makespans: " + ", ".join(f"{m:.1f}" for m in r["makespans_s"]) + " s")
    header = {"torch": torch.__version__, "lightning": L.__version__, "optuna": optuna.__version__}
    suffix = ("_gpu" if args.accelerator == "gpu" else "") + ("_unpruned" if args.pruner == "none" else "")
    results = RESULTS.with_name(f"{RESULTS.stem}{suffix}.json")
    results.write_text(
        json.dumps({**header, "python": platform.python_version(), "args": vars(args), "rows": rows}, indent=2) + "\n"
    )
    print(f"wrote {results.relative_to(ROOT)}")
    return None


if __name__ == "__main__":
    main()
