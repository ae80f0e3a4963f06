"""The SLURM job this process runs in: is Lightning's auto-requeue on, was the job requeued, requeue it."""

from __future__ import annotations

import logging
import os
import subprocess

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["auto_requeue", "is_requeued_job", "requeue_job"]

log = logging.getLogger(__name__)


def auto_requeue(trainer: pl.Trainer) -> bool:
    """Whether the trainer runs as a SLURM job with Lightning's auto-requeue on (its default there)."""
    environment = trainer.strategy.cluster_environment
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue


def is_requeued_job() -> bool:
    """Whether this process belongs to a SLURM job that was requeued (on request, or after a node failure)."""
    return SLURMEnvironment.detect() and int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0


def requeue_job() -> None:
    """Put this SLURM job (or array task) back in the queue with ``scontrol requeue``."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode == 0:
        log.info(f"Requeued SLURM job {job}")
    else:
        rank_zero_warn(
            f"`scontrol requeue {job}` failed ({result.returncode}): {result.stderr.strip()}. The job ends here;"
            ' submit it again to resume from the checkpoint (`fit(ckpt_path="last")`).'
        )
