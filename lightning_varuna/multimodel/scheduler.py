"""Hand out devices a shard at a time to the models of a sweep, longest remaining time first (Hydra's LRTF).

Every model trains in its own thread; before each piece of shard work (a forward, a backward, an optimizer step) it
asks for a turn on a device and gives the device back afterwards. When a device is free, the waiting model with the
longest remaining time gets it. A model's remaining time is its remaining optimizer steps times the device time its
steps took so far; until a model has stepped, it is estimated from its size (the bytes its segments were measured to
need) at the rate measured on the
models that have stepped (or, before any has, models are ranked by size times steps).

Models whose forward draws random numbers (dropout) take turns one at a time on torch's global generator, so that
each shard's recompute replays the same numbers; whether a forward draws is found out on its first, exclusive, run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["DeviceScheduler", "DeviceSpan", "ModelClock", "SweepStopped"]


class SweepStopped(Exception):
    """Raised in a model's thread at its next shard boundary when the sweep is stopped (SIGTERM, Ctrl-C)."""


@dataclass(frozen=True)
class DeviceSpan:
    """One turn: ``model`` ran ``work`` on ``shard`` on ``device`` (seconds of `time.perf_counter`)."""

    device: int
    model: str
    work: str
    shard: int
    start_s: float
    end_s: float


@dataclass
class ModelClock:
    """What the scheduler knows of one model's progress."""

    name: str
    size: int  # the bytes its segments need on a device (parameters, gradients, optimizer state, activations)
    total_steps: float = float("inf")
    steps_done: int = 0  # optimizer steps taken in this sweep
    steps_before: int = 0  # optimizer steps already taken when the fit started (a resumed run)
    device_s: float = 0.0  # device time of its turns so far
    finished: bool = False
    draws: dict[tuple[int, bool], bool] = field(default_factory=dict)  # (shard, training) -> its forward draws

    @property
    def remaining_steps(self) -> float:
        return max(self.total_steps - self.steps_before - self.steps_done, 0)


@dataclass
class _Request:
    clock: ModelClock
    needs_generator: bool
    order: int
    device: int | None = None


class DeviceScheduler:
    """``devices`` device slots shared by the models of a sweep, handed out longest remaining time first."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.spans: list[DeviceSpan] = []
        self._free = list(range(devices))
        self._generator_busy = False
        self._waiting: list[_Request] = []
        self._clocks: dict[str, ModelClock] = {}
        self._changed = threading.Condition()
        self._arrivals = 0
        self._stopped: str | None = None

    def add(self, name: str, size: int) -> ModelClock:
        """Register a model by ``name`` (unique) with its size, for estimates until it has stepped."""
        clock = self._clocks[name] = ModelClock(name, size)
        return clock

    def clock(self, name: str) -> ModelClock:
        return self._clocks[name]

    # ------------------------------------------------------------------------------------ remaining time
    def remaining_s(self, clock: ModelClock) -> float:
        """The device time ``clock``'s model still needs: measured, or estimated from its size (see module)."""
        if clock.steps_done:
            return clock.remaining_steps * clock.device_s / clock.steps_done
        stepped = [c for c in self._clocks.values() if c.steps_done]
        per_byte_step = (
            sum(c.device_s for c in stepped) / sum(c.size * c.steps_done for c in stepped) if stepped else 1.0
        )
        return clock.remaining_steps * clock.size * per_byte_step

    def stepped(self, name: str, steps_done: int, total_steps: float, steps_before: int) -> None:
        """Record a model's progress (after each optimizer step)."""
        with self._changed:
            clock = self._clocks[name]
            clock.steps_done, clock.total_steps, clock.steps_before = steps_done, total_steps, steps_before
            self._changed.notify_all()

    def finished(self, name: str) -> None:
        """The model's fit has ended (done, failed or stopped): it asks for no more turns."""
        with self._changed:
            self._clocks[name].finished = True
            self._changed.notify_all()

    def stop(self, reason: str) -> None:
        """Stop the sweep: every model raises `SweepStopped` when it next asks for a turn."""
        with self._changed:
            self._stopped = reason
            self._changed.notify_all()

    def queue(self) -> list[str]:
        """The models waiting for a device, longest remaining time (next served) first."""
        with self._changed:
            return [r.clock.name for r in self._by_priority()]

    def _by_priority(self) -> list[_Request]:
        return sorted(self._waiting, key=lambda r: (-self.remaining_s(r.clock), r.order))

    # ------------------------------------------------------------------------------------------------ turns
    @contextmanager
    def turn(self, name: str, work: str, shard: int, training: bool = False, generator: bool = False) -> Iterator[bool]:
        """Wait for a device, run the block on it, give it back; yields whether the turn holds torch's global generator.

        Forward and backward turns of a model whose forward draws random numbers (or may: its first) hold the
        generator, as do turns asking for it (``generator``); other threads draw nothing from it meanwhile, except
        from outside their turns.
        """
        clock = self._clocks[name]
        draws = clock.draws.get((shard, training)) if work in ("forward", "backward") else False
        request = self._wait(clock, needs_generator=generator or draws is not False)
        before = torch.get_rng_state() if draws is None and work == "forward" else None
        start = time.perf_counter()
        try:
            yield request.needs_generator
        finally:
            end = time.perf_counter()
            if before is not None:
                clock.draws[(shard, training)] = not torch.equal(before, torch.get_rng_state())
            with self._changed:
                assert request.device is not None
                self._free.append(request.device)
                self._generator_busy &= not request.needs_generator
                clock.device_s += end - start
                self.spans.append(DeviceSpan(request.device, name, work, shard, start, end))
                self._changed.notify_all()

    def _wait(self, clock: ModelClock, needs_generator: bool) -> _Request:
        with self._changed:
            self._arrivals += 1
            request = _Request(clock, needs_generator, self._arrivals)
            self._waiting.append(request)
            try:
                while not self._granted(request):
                    if self._stopped is not None:
                        raise SweepStopped(f"the sweep was stopped ({self._stopped})")
                    self._changed.wait()
            finally:
                self._waiting.remove(request)
            if self._stopped is not None:
                self._free.append(request.device)  # type: ignore[arg-type]
                self._changed.notify_all()
                raise SweepStopped(f"the sweep was stopped ({self._stopped})")
            return request

    def _granted(self, request: _Request) -> bool:
        """Whether ``request`` is among those the free devices go to now, longest remaining time first (earlier
        arrivals first among equals); if so, take its device (and the generator)."""
        free, generator_busy = len(self._free), self._generator_busy
        for waiting in self._by_priority():
            if free == 0:
                return False
            if waiting.needs_generator and generator_busy:
                continue
            if waiting is request:
                request.device = self._free.pop(0)
                self._generator_busy |= request.needs_generator
                return True
            free -= 1
            generator_busy |= waiting.needs_generator
        return False
