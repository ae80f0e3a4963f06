"""Time a few real training steps of a model on this machine, and calibrate its profile with them.

The profile times each segment alone; a real step also runs the pipeline runtime around every forward and backward,
its messages, the gradient sums and Lightning's loop, and the optimizer finds its state out of the caches. Here the
model trains for a few steps with `VarunaStrategy` at a few configurations per process count (`step_run_configs`).
Its step sums the model's outputs on its example inputs (the profiler knows neither the user's data nor the loss).
The measured timelines (`PipelineTrace`) then calibrate the profile (`calibrate`), so that it predicts steps as this
machine runs them without a run of the user's own (on examples/gpt.py's GPT on 2 CPU cores, the profile alone
under-predicted every configuration by 5-39% before; benchmarks/README.md, "Simulator accuracy").
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from lightning_varuna.callbacks.pipeline_trace import PipelineTrace
from lightning_varuna.profiling.calibration import calibrate
from lightning_varuna.profiling.processes import retried_on_port_clash
from lightning_varuna.profiling.profile import ModelProfile
from lightning_varuna.profiling.profiler import optimizer_of, resize_batch
from lightning_varuna.profiling.segments import float_leaves
from lightning_varuna.profiling.simulator import Config
from lightning_varuna.profiling.trace import Span, read_chrome_trace
from lightning_varuna.strategies.varuna import VarunaStrategy

__all__ = ["calibrate_with_steps", "step_run_configs"]

_MICROBATCHES = 4  # per pipeline stage and step: enough for the schedule to reach its steady state


def step_run_configs(profile: ModelProfile, processes: int) -> list[Config]:
    """The configurations run with ``processes`` processes: a pipeline of as many stages (as many as the model has
    segments for and divide the processes, the rest replicas) at the smallest, a middle and the largest profiled
    micro-batch size, at the middle size with its backward split (zero-bubble: how long a deferred weight pass
    takes), and replicas of the whole model (how long they wait for each other at the all-reduce)."""
    sizes = profile.micro_batch_sizes
    middle = sizes[len(sizes) // 2]
    stages = max(n for n in range(1, min(processes, len(profile.segments)) + 1) if processes % n == 0)
    replicas = processes // stages

    def config(micro_batch_size: int, schedule: str, stages: int = stages, replicas: int = replicas) -> Config:
        rows = micro_batch_size * _MICROBATCHES * stages * replicas
        return Config(stages, replicas, micro_batch_size, schedule, rows)

    configs = [config(mb, "1f1b") for mb in dict.fromkeys((sizes[0], middle, sizes[-1]))]
    if stages > 1:
        configs.append(config(middle, "zero-bubble"))
    if replicas == 1 and processes > 1:
        configs.append(config(middle, "1f1b", 1, processes))
    return configs


def calibrate_with_steps(
    profile: ModelProfile,
    module: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    process_counts: Sequence[int] = (1,),
    steps: int = 4,
    warmup: int = 3,
    progress: bool = True,
) -> ModelProfile:
    """A copy of ``profile`` calibrated with a few training steps of ``module`` (a copy of it: the module is left as
    it was) at the configurations of `step_run_configs` for each of ``process_counts``, in CPU processes started by
    a fork server (a fork of this process, which has computed with several threads, could hang in OpenMP).

    The model and its inputs are sent to those processes: they must pickle, their classes importable by name (not
    defined in a notebook), and a script calling this needs an ``if __name__ == "__main__":`` guard.

    Args:
        args, kwargs: one batch of forward inputs (resized to each configuration's batch, as the profiler does).
        steps: steps timed per configuration (the median one counts), after ``warmup`` steps.
    """
    configs = [config for n in sorted(set(process_counts)) for config in step_run_configs(profile, n)]
    multiprocessing.set_forkserver_preload(["__main__", __name__])  # the runs' processes start with these imported
    measured: list[tuple[Config, list[Span]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = str(Path(tmp) / "profile.json")
        _as_wrapped(profile).save(profile_path)
        for config in tqdm(configs, desc="Timing training steps", disable=not progress, unit="run"):
            trace = Path(tmp) / f"{len(measured)}.json"
            with _quiet():
                _train(config, module, args, kwargs or {}, profile_path, str(trace), steps, warmup)
            spans, metadata = read_chrome_trace(trace.read_text())
            measured.append((Config(**metadata["config"]), spans))
    return calibrate(profile, measured)


def _silence_lightning() -> list[tuple[logging.Logger, int]]:
    """Leave out Lightning's start-up lines and warnings (about this machine, the data loading): the runs are the
    profiler's, not the user's. Returns the loggers' levels before (some of Lightning's set one of their own)."""
    names = ["lightning.pytorch", "lightning.fabric", "lightning_varuna", *logging.Logger.manager.loggerDict]
    loggers = [logging.getLogger(name) for name in names if name.startswith(("lightning.", "lightning_varuna"))]
    levels = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    return levels


@contextmanager
def _quiet() -> Iterator[None]:
    """Lightning silenced inside the block (`_silence_lightning`)."""
    with warnings.catch_warnings():
        levels = _silence_lightning()
        try:
            yield
        finally:
            for logger, level in levels:
                logger.setLevel(level)


class _Repeated(Dataset):
    """``times`` items, each ``batch``: a DataLoader of ``batch_size=None`` yields it as a batch."""

    def __init__(self, batch: Any, times: int) -> None:
        self.batch, self.times = batch, times

    def __len__(self) -> int:
        return self.times

    def __getitem__(self, index: int) -> Any:
        return self.batch


def _as_wrapped(profile: ModelProfile) -> ModelProfile:
    """``profile`` as of `_SummedOutputs` holding the model: its CutPoints are the model's, under ``model.``."""
    cutpoints = set(profile.cutpoints)
    renamed = [replace(s, name=f"model.{s.name}") if s.name in cutpoints else s for s in profile.segments]
    return replace(profile, segments=renamed)


class _SummedOutputs(pl.LightningModule):
    """A training step that sums the model's outputs, with the model's own optimizer."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def __setstate__(self, state: dict) -> None:
        """As each of the run's processes receives the model: Lightning's start-up lines left out there too."""
        super().__setstate__(state)
        _silence_lightning()  # for the rest of the process, which ends with the run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: tuple[tuple, dict], batch_idx: int) -> Tensor:
        args, kwargs = batch
        return torch.stack([t.float().sum() for t in float_leaves(self(*args, **kwargs))]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer_cls, defaults = optimizer_of(self.model)
        return optimizer_cls(self.parameters(), **defaults)


def _train(
    config: Config, module: nn.Module, args: tuple, kwargs: dict, profile: str, trace: str, steps: int, warmup: int
) -> None:
    replica_batch = resize_batch((args, kwargs), config.replica_batch_size)
    data = DataLoader(_Repeated(replica_batch, (warmup + steps) * config.data_parallel_size), batch_size=None)

    def fit() -> None:
        with _own_port():
            _trainer(config, profile, trace, steps, warmup).fit(_SummedOutputs(copy.deepcopy(module)), data)

    retried_on_port_clash(fit)


def _trainer(config: Config, profile: str, trace: str, steps: int, warmup: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=config.world_size,
        strategy=VarunaStrategy(
            pipeline_parallel_size=config.pipeline_parallel_size,
            micro_batch_size=config.micro_batch_size,
            schedule=config.schedule,
            profile=profile,
            cluster_environment=LightningEnvironment(),  # this machine's processes, under SLURM or torchrun too
            start_method="forkserver",
        ),
        max_steps=warmup + steps,
        callbacks=[PipelineTrace(trace, step=warmup, steps=steps)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


@contextmanager
def _own_port() -> Iterator[None]:
    """A run on a free port of its own: the launcher finds one and sets ``MASTER_PORT``; set as it was afterwards."""
    before = os.environ.pop("MASTER_PORT", None)
    try:
        yield
    finally:
        os.environ.pop("MASTER_PORT", None)
        if before is not None:
            os.environ["MASTER_PORT"] = before
