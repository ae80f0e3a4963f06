"""Measure what spilling a shard's part and fetching it back costs on each tier, with the spill store itself, for
the simulator's predictions of spilled steps (`lightning-varuna profile` stores them in the profile)."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_varuna.profiling.profile import LinearCost, SpillCosts
from lightning_varuna.spilling.store import SpillStore

__all__ = ["measure_spill_tiers"]

_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)  # bytes of a part: a layer's parameters to a large shard's state


def measure_spill_tiers(
    device: torch.device,
    spill_dir: str | Path | None = None,
    *,
    sizes: Sequence[int] = _SIZES,
    repeats: int = 3,
) -> dict[str, SpillCosts]:
    """Seconds to spill a part of each size in ``sizes`` and to fetch it back, in host memory (``"host"``) and in
    files in a fresh folder under ``spill_dir`` (``"disk"``; default: the system's temporary folder), as the store
    does it in training: each part rewritten in place and read back into a buffer used again (the first round, which
    allocates them, is left out); the median of ``repeats``."""
    costs = {"host": _measure(SpillStore(device), sizes, repeats)}
    with tempfile.TemporaryDirectory(prefix="spill-bandwidth-", dir=spill_dir) as folder:
        costs["disk"] = _measure(SpillStore(device, folder), sizes, repeats)
    return costs


def _measure(store: SpillStore, sizes: Sequence[int], repeats: int) -> SpillCosts:
    reads: list[tuple[int, float]] = []
    writes: list[tuple[int, float]] = []
    try:
        for size in sizes:
            part = [torch.ones(size // 4, dtype=torch.float32, device=store.device)]
            read_s, write_s = [], []
            for round_ in range(repeats + 1):
                key = f"part{size}"
                _synchronize(store.device)
                start = time.perf_counter()
                store.put(key, part)
                store.wait_written(key)
                _synchronize(store.device)
                middle = time.perf_counter()
                part = store.get(key)
                _synchronize(store.device)
                if round_:
                    write_s.append(middle - start)
                    read_s.append(time.perf_counter() - middle)
            writes.append((size, statistics.median(write_s)))
            reads.append((size, statistics.median(read_s)))
            store.discard(f"part{size}")
            del part
    finally:
        store.close()
    return SpillCosts(read=LinearCost.fit(reads), write=LinearCost.fit(writes))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
