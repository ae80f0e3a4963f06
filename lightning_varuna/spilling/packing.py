"""Pack a model's segments (the pieces between its CutPoints) into shards that fit a device memory budget."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["SegmentMemory", "format_bytes", "pack_shards", "parse_bytes", "shard_share"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_bytes(size: int | float | str) -> int:
    """``2048``, ``2e9``, ``"512MB"``, ``"2GiB"``, ``"1.5 GB"`` -> bytes."""
    if isinstance(size, bool) or not isinstance(size, (int, float, str)):
        raise TypeError(f"`memory_budget={size!r}`: write a number of bytes or a size such as '512MB' or '2GiB'.")
    if isinstance(size, (int, float)):
        value = int(size)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"`memory_budget={size!r}`: write a number of bytes or a size such as '512MB' or '2GiB'.")
        value = int(float(match.group(1)) * _UNITS[unit])
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


def pack_shards(segments: list[SegmentMemory], budget: int, kept: int, prefetch: bool = True) -> list[list[int]]:
    """Consecutive segments grouped into as few shards as fit ``budget``: a shard's state and activations, plus
    (with ``prefetch``) the next shard arriving while it computes, next to the ``kept`` bytes that stay on the
    device throughout (activations at shard boundaries, buffers, tied parameters).

    Raises ValueError naming a segment that cannot fit on its own.
    """
    if kept >= budget:
        raise ValueError(
            f"`memory_budget` of {format_bytes(budget)} is less than the {format_bytes(kept)} that stay on the device "
            "throughout (activations at CutPoints, buffers, parameters used in several places). Raise the budget."
        )
    left = budget - kept
    share = shard_share(budget, kept, prefetch)
    shards: list[list[int]] = []
    used = 0
    for index, segment in enumerate(segments):
        need = segment.state_bytes + segment.activation_bytes
        if need > share:
            state, activations = format_bytes(segment.state_bytes), format_bytes(segment.activation_bytes)
            half = " (half: the next shard is fetched meanwhile)" if prefetch else ""
            raise ValueError(
                f"The segment {segment.name} needs {format_bytes(need)} on the device ({state} of parameters, "
                f"gradients and optimizer state, {activations} of activations), but a shard may use "
                f"{format_bytes(share)}{half} of the {format_bytes(left)} left for shards in the budget of "
                f"{format_bytes(budget)}. Add CutPoints inside it or raise `memory_budget`."
            )
        if shards and used + need <= share:
            shards[-1].append(index)
            used += need
        else:
            shards.append([index])
            used = need
    return shards


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
