"""Process groups for VarunaStrategy: started by Lightning, torchrun (elastic, restartable) or SLURM."""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from lightning_varuna._lightning_private import (
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
)

__all__ = ["choose_backend", "init_process_group", "torchrun_layout"]

log = logging.getLogger(__name__)


def torchrun_layout(
    environment: ClusterEnvironment, devices: list[torch.device]
) -> tuple[list[torch.device], int] | None:
    """Under torchrun, the devices of this node and the node count that torchrun chose (whatever the Trainer's
    ``devices`` and ``num_nodes`` say, so one script runs at every size of an elastic job); else None."""
    if not isinstance(environment, TorchElasticEnvironment) or "LOCAL_WORLD_SIZE" not in os.environ:
        return None
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    device = devices[0]
    if len(devices) != per_node:
        devices = [device if device.type == "cpu" else torch.device(device.type, i) for i in range(per_node)]
    return devices, environment.world_size() // per_node


def choose_backend(backend: str | None, devices: list[torch.device], device: torch.device) -> str:
    """``backend``, or by default Lightning's for ``device``; gloo where processes of the node share a GPU
    (``devices`` repeats one), which NCCL refuses: for every process of the job alike, whichever GPU it has."""
    shared = [d for d in dict.fromkeys(devices) if d.type == "cuda" and devices.count(d) > 1]
    if backend is not None and "nccl" in backend and shared:
        raise ValueError(
            f"The processes of this node share {shared[0]} (`parallel_devices` names it {devices.count(shared[0])} "
            "times), and NCCL refuses two ranks on one GPU: leave `process_group_backend` unset (gloo, the default "
            "where ranks share a GPU) or give each process a GPU of its own."
        )
    return backend or ("gloo" if shared else default_process_group_backend(device))


def init_process_group(
    environment: ClusterEnvironment, backend: str, device: torch.device, timeout: timedelta | None
) -> None:
    """Start the default process group of this job (once per process) for this process's ``device``, over
    ``backend`` (see `choose_backend`)."""
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    # gloo's worker threads abort the process ("terminate called without an active exception") when the
    # interpreter finalises before the groups are destroyed: destroy them while it is still alive.
    atexit.unregister(_destroy_process_groups)
    atexit.register(_destroy_process_groups)
    if not isinstance(environment, TorchElasticEnvironment) or distributed_is_initialized():
        init_dist_connection(environment, backend, timeout=timeout, **kwargs)
        return
    # torchrun keeps its store across the restarts of a job: key the process groups by restart (after a
    # failure) and world size (after machines joined), or the groups of a restarted job read the addresses
    # their dead predecessors left and connect to nothing.
    rank, world_size = environment.global_rank(), environment.world_size()
    rendezvous = dist.rendezvous("env://", rank, world_size, timeout=timeout)
    store, rank, world_size = next(rendezvous)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"lightning_varuna/restart_{restart}/world_{world_size}", store)
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def _destroy_process_groups() -> None:
    if distributed_is_initialized():
        dist.destroy_process_group()
