"""Pack a model's segments (the pieces between its CutPoints) into shards that fit a device memory budget.

Pure planning over measured sizes: `SpillingStrategy` packs by it at set-up, and the simulator predicts a spilled
step from the very same packing."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Packing", "SegmentMemory", "format_bytes", "pack_shards", "parse_bytes", "shard_share", "smallest_budgets"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*")
_HOW = "write a number of bytes, a size such as '512MB' or '2GiB', or a share of the device's memory such as '50%'"


def parse_bytes(size: int | float | str) -> int | float:
    """``2048``, ``2e9``, ``"512MB"``, ``"2GiB"``, ``"1.5 GB"`` -> bytes (an int); ``"50%"`` -> 0.5, a share of the
    device's memory (`resolve_budget` turns it into bytes)."""
    if isinstance(size, bool) or not isinstance(size, (int, float, str)):
        raise TypeError(f"`memory_budget={size!r}`: {_HOW}.")
    if isinstance(size, float) and not size.is_integer():
        share = f" For a share of the device's memory write '{size * 100:g}%'." if 0 < size < 1 else ""
        raise ValueError(f"`memory_budget={size!r}` is not a whole number of bytes (a number is bytes).{share}")
    if isinstance(size, (int, float)):
        value: int | float = int(size)
    else:
        match = _SIZE.fullmatch(size)
        unit = match.group(2).upper() if match else None
        if match is None or (unit not in _UNITS and unit != "%"):
            raise ValueError(f"`memory_budget={size!r}`: {_HOW}.")
        number = float(match.group(1))
        if unit == "%":
            if not 0 < number <= 100:
                raise ValueError(
                    f"`memory_budget={size!r}`: a share of the device's memory is over 0% and at most 100%."
                )
            return number / 100
        value = int(number * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"`memory_budget={size!r}` must be more than 0 bytes.")
    return value


@dataclass(frozen=True)
class SegmentMemory:
    """What one segment holds on the device while it trains, measured.

    Attributes:
        name: how the user finds it: the CutPoints around it.
        state_bytes: its parameters, their gradients and the optimizer's state of them.
        activation_bytes: what autograd keeps during its forward for its backward (held while it is recomputed).
    """

    name: str
    state_bytes: int
    activation_bytes: int

    @property
    def need(self) -> int:
        return self.state_bytes + self.activation_bytes


@dataclass(frozen=True)
class Packing:
    """Shards for a budget.

    Attributes:
        shards: the segments of each shard, consecutive.
        overlaps: for each shard but the last, whether it and the next one fit on the device together (so that one
            is fetched while the other computes); False around a shard that takes more than half of the room.
        keeps: for each shard, whether its forward keeps the activations its backward needs (held on the device
            until then) instead of being computed again in backward.
        kept_activation_bytes: the activations the shards that keep them hold at most, all together.
    """

    shards: list[list[int]]
    overlaps: list[bool]
    keeps: list[bool]
    kept_activation_bytes: int


def pack_shards(
    segments: list[SegmentMemory], budget: int, kept: int, prefetch: bool = True, training: bool = True
) -> Packing:
    """Consecutive segments grouped into as few shards as fit ``budget``: a shard's state and activations, plus
    (with ``prefetch``) the next shard arriving while it computes, next to the ``kept`` bytes that stay on the
    device throughout (activations at CutPoints, buffers, tied parameters).

    A segment that fits the room left beside ``kept`` but not half of it is a shard of its own, alone on the device
    (nothing fetched while it computes). In training, shards keep the activations their backward needs (instead of
    computing them again) where the room allows as few shards, each as prefetched: those of the last segments first.

    Raises ValueError, naming the smallest budget that trains the model and the one that keeps prefetch, if a
    segment does not fit on its own.
    """
    room = budget - kept
    if room < max(segment.need for segment in segments):
        raise ValueError(_too_small(segments, budget, kept, prefetch))
    shards = _pack(segments, room, prefetch)
    assert shards is not None
    overlaps = _overlaps(shards, segments, room, prefetch)
    if training:
        for first in range(len(segments)):  # keep the activations of segments[first:]
            extra = sum(segment.activation_bytes for segment in segments[first:])
            keeping = _pack(segments, room - extra, prefetch)
            if keeping is None or len(keeping) > len(shards):
                continue
            keeping_overlaps = _overlaps(keeping, segments, room - extra, prefetch)
            if keeping_overlaps.count(False) <= overlaps.count(False):
                keeps = [shard[0] >= first for shard in keeping]
                return Packing(keeping, keeping_overlaps, keeps, extra)
    return Packing(shards, overlaps, [False] * len(shards), 0)


def smallest_budgets(segments: list[SegmentMemory], kept: int) -> tuple[int, int, SegmentMemory]:
    """The smallest budget that trains these segments next to ``kept`` bytes (the largest segment alone on the
    device), the smallest with which every shard is fetched while its neighbour computes, and the segment that sets
    them."""
    largest = max(segments, key=lambda segment: segment.need)
    smallest = low = kept + largest.need
    high = kept + 2 * largest.need  # every segment fits half the room: every neighbour fits beside it
    while low < high:  # bisect between them: fewer bytes may do where the neighbours of the largest are small
        middle = (low + high) // 2
        shards = _pack(segments, middle - kept, prefetch=True)
        if shards is not None and all(_overlaps(shards, segments, middle - kept, prefetch=True)):
            high = middle
        else:
            low = middle + 1
    return smallest, high, largest


def _pack(segments: list[SegmentMemory], room: int, prefetch: bool) -> list[list[int]] | None:
    """Greedy packing into shards of at most half the ``room`` (all of it without prefetch); a segment larger than
    that half is a shard of its own. None if a segment needs more than the room."""
    share = room // 2 if prefetch else room
    shards: list[list[int]] = []
    used = 0
    for index, segment in enumerate(segments):
        if segment.need > room:
            return None
        if shards and used + segment.need <= share:
            shards[-1].append(index)
            used += segment.need
        else:
            shards.append([index])
            used = segment.need
    return shards


def _overlaps(shards: list[list[int]], segments: list[SegmentMemory], room: int, prefetch: bool) -> list[bool]:
    """Whether each shard and the next fit on the device together."""
    needs = [sum(segments[s].need for s in shard) for shard in shards]
    return [prefetch and a + b <= room for a, b in zip(needs, needs[1:])]


def _too_small(segments: list[SegmentMemory], budget: int, kept: int, prefetch: bool) -> str:
    smallest, with_prefetch, largest = smallest_budgets(segments, kept)
    state, activations = format_bytes(largest.state_bytes), format_bytes(largest.activation_bytes)
    keeping = (
        f"; `memory_budget={with_prefetch}` ({format_bytes(with_prefetch)}) also fetches each shard while the one "
        "before computes"
        if prefetch
        else ""
    )
    return (
        f"`memory_budget={budget}` ({format_bytes(budget)}) is too small: the segment {largest.name} needs "
        f"{format_bytes(largest.need)} on the device ({state} of parameters, gradients and optimizer state, "
        f"{activations} of activations), next to the {format_bytes(kept)} that stay there throughout (activations "
        f"at CutPoints, buffers, parameters used in several places). The smallest budget that trains this model at "
        f"this batch size is `memory_budget={smallest}` ({format_bytes(smallest)}){keeping}. To lower both, add "
        f"CutPoints inside the segment {largest.name} (see 'Cutting around a large layer' in the spilling docs)."
    )


def shard_share(budget: int, kept: int, prefetch: bool) -> int:
    """What one shard may use of ``budget`` next to the ``kept`` bytes: half of the rest with ``prefetch`` (the next
    shard arrives meanwhile)."""
    left = budget - kept
    return left // 2 if prefetch else left


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
