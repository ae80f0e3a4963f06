"""The SLURM job this process runs in: whether Lightning's auto-requeue is on, whether the job was requeued,
and requeueing it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["is_requeued_job", "job_id", "requeue_job", "requeue_signal"]

log = logging.getLogger(__name__)


def requeue_signal(trainer: pl.Trainer) -> signal.Signals | None:
    """The signal that asks this SLURM job to requeue (``SLURMEnvironment.requeue_signal``, SIGUSR1 by default);
    None outside SLURM or with Lightning's auto-requeue off (``SLURMEnvironment(auto_requeue=False)``). The
    environment is the one Lightning's requeue handler reads, which a single-device strategy has too."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def is_requeued_job() -> bool:
    """Whether this process belongs to a SLURM job that was requeued (on request, or after a node failure)."""
    return SLURMEnvironment.detect() and int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0


def job_id() -> str:
    """This job's id, ``<array job>_<task>`` for a task of a job array; a requeued job keeps it."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]


def requeue_job(checkpoint: str | None = None) -> None:
    """Put this SLURM job back in the queue (``scontrol requeue``); SLURM then stops its processes. On failure,
    warn and say how to resume from ``checkpoint``."""
    job = job_id()
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = str(err)
    else:
        if result.returncode == 0:
            log.info(f"Requeued SLURM job {job}")
            return
        failure = f"exit code {result.returncode}: {result.stderr.strip()}"
    resume = f' Submit it again with `fit(ckpt_path="{checkpoint}")` to resume.' if checkpoint else ""
    rank_zero_warn(f"`scontrol requeue {job}` failed ({failure}). The job ends here.{resume}")
