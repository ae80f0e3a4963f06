"""The sweep's devices: a core of the process per CPU device, one CUDA GPU, torch's threads while a sweep runs, and
which models stay on the GPU between their turns."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["check_one_gpu", "cores_for", "staying_models", "torch_threads"]


def staying_models(sizes: list[int], steps: list[float], room: int) -> list[bool]:
    """Whether each model (its state's bytes, its steps: infinite if unknown) stays on the device within ``room``.

    A model that stays saves copying its state out and back every step: its bytes times its steps. Taken by steps,
    longest first (the larger first among equals, then in the order added), each model stays if it still fits beside
    those taken before it.
    """
    stays = [False] * len(sizes)
    taken = 0
    for i in sorted(range(len(sizes)), key=lambda i: (-steps[i], -sizes[i], i)):
        if taken + sizes[i] <= room:
            stays[i], taken = True, taken + sizes[i]
    return stays


def check_one_gpu(devices: int) -> None:
    """Refuse a GPU sweep without a CUDA GPU, or over more than one."""
    if not torch.cuda.is_available():
        raise ValueError(
            "MultiModelTrainer(accelerator='gpu') needs a CUDA GPU, and torch sees none. Use accelerator='cpu'."
        )
    if devices != 1:
        raise NotImplementedError(
            f"MultiModelTrainer trains a sweep on one GPU for now, not devices={devices}: run one sweep per GPU "
            "(each process seeing its own, `CUDA_VISIBLE_DEVICES=k`), or several on the CPU."
        )


def cores_for(devices: int) -> list[int] | None:
    """A core of this process's for each device, if it has that many (and the OS lets threads be pinned)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores[:devices] if len(cores) >= devices else None


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch computes with ``count`` threads in the block (a CPU device is one core), then as before."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
