"""Hand out devices a shard at a time to the models of a sweep, longest remaining time first (Hydra's LRTF).

Every model trains in its own thread; before each piece of shard work (a forward, a backward, an optimizer step) it
asks for a turn on a device and gives the device back afterwards. When a device is free, the waiting model with the
longest remaining time gets it. A model's remaining time is its remaining optimizer steps times the device time its
steps took so far. A step counts as done once its turns have taken more than half a step's device time: a model is
ranked again as its step ends, before Lightning's code between steps reports it, so no device is held for a model
that has just stopped being among the longest (nor is a model ranked again in the middle of a step). Until a model
has stepped, its remaining time is estimated from its size (the bytes its segments were measured to need) at the rate
measured on the models that have stepped (or, before any has, models are ranked by size times steps).

A model that may end early (a trial that its study's pruner may stop) says when the next decision on it comes (a
global step) and what share of models go on past such a decision. Ranked by ``"expected"`` remaining time, such a
model's remaining time is its time to that decision plus that share of the rest: a trial that a successive-halving
pruner promotes one in three times counts a third of its time past its next rung. Ranked by ``"end"`` (the default),
every model counts its time to its end. A model that no pruner stops counts its time to its end either way. Side by
side in ``benchmarks/model_selection.py``, ``"end"`` kept the devices busier (see ``benchmarks/README.md``).

Between two turns a model runs Lightning's own code for a moment. So that the D models with the longest remaining
time keep their devices rather than queue behind shorter models' shards each time, a device they just gave back is
held for them for up to `HOLD_S`, unless they are all waiting already. One thread of the scheduler's dispatches again
as such holds end; it lives while holds keep coming (a thread started for each hold cost a small model's sweep 25 s
of its threads' time over 3,872 turns).

A turn taken by a model inside a turn of its own (in the same thread) runs in that turn: a model whose whole step
is one turn (`SweepMemberStrategy.optimizer_step`) runs its forward and backward inside it, and the turn holds the
generator if they need it.

Models whose forward draws random numbers (dropout) take turns one at a time on torch's global generator, so that
each shard's recompute replays the same numbers. While a model holds the generator, it draws from a state of its own
(``random_state``, given by `add`): the generator is put in that state as the model takes it, and the state is kept
as the model gives it back, the process's own state put back meanwhile. So each model draws the numbers it would
draw alone, whatever the other models drew between its turns. Whether a forward draws is found out at set-up, which
runs the model holding the generator (or else on the forward's first, exclusive, run), so that models that draw
none can train on one device while the others are still being set up on another. A model can also hold the
generator without a device (`hold_generator`, `generator_held`), while its own turns go on: Lightning restores the
generator's state after its sanity check, outside any turn, which must not land in the middle of another model's
forward. Such holds are served first, so that a model just set up starts training before the next set-up takes the
generator.

On the CPU a device is a core: a turn on device k runs with its thread pinned to the k-th of ``cores``, so that two
turns never share a core while another core idles, and a computing thread is not moved between cores (measured: a
sweep's makespan 2-3% shorter at batches of 256 rows). A thread is pinned when it first runs on a core and stays
pinned there between its turns, until a turn on another device (a model is given the device of its last turn when
it is free): pinning it for each turn and back after took 7 ms a call on a loaded machine, longer than a small
model's turn. ``pin=False`` leaves the threads where the OS puts them. A one-device sweep in a worker process may
also compute on cores that other workers lend it (``lent``, `CoreLending`): each turn then starts on those too.

On CUDA a device is a GPU: a turn on device k runs with ``gpus[k]`` as the current device. A GPU works
asynchronously: a turn ends when its work is issued, so its time (what the ranking counts, and `spans`) is the host's
time issuing that work. When the GPU ran it is measured apart, by a pair of CUDA events around each turn on the
stream it issued to (`gpu_spans`, read once the sweep is over).

A model traces its forward (at set-up, and for inputs of a new shape) `alone`: while no other model is in a turn.
torch.export marks the whole process as compiling while it traces (`torch.compiler.is_compiling()`), and optimizers
and modules take other code paths then, which round differently: a model stepping meanwhile would not train exactly
as alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from lightning_varuna.multimodel.core_lending import LentCores
from lightning_varuna.pipeline.replay import generator_states, set_generator_states, states_differ

__all__ = ["HOLD_S", "DeviceScheduler", "DeviceSpan", "ModelClock", "Ranking", "SweepStopped"]

Ranking = Literal["expected", "end"]  # what a model's remaining time counts (see the module)

HOLD_S = 0.01  # how long a device given back by one of the D longest models waits for that model's next turn


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
    setup_s: float = 0.0  # of which its set-up's
    stepped_s: float = 0.0  # the device time its training had taken at its last optimizer step
    finished: bool = False
    turns: int = 0  # turns it holds or waits for now
    released_s: float = -float("inf")  # when its last turn ended
    draws: dict[tuple[int, bool], bool] = field(default_factory=dict)  # (shard, training) -> its forward draws
    decides_at: float = float("inf")  # the global step of the next decision that may end it early (a pruner's)
    goes_on: float = 1.0  # the share of models that go on past such a decision
    device: int | None = None  # the device of its last turn
    random_state: list[torch.Tensor] | None = None  # its generators' state while it does not hold them (see module)

    @property
    def remaining_steps(self) -> float:
        return max(self.total_steps - self.steps_before - self.steps_done, 0)

    @property
    def steps_to_decision(self) -> float:
        """Steps until the next decision that may end it early, or until its end if that comes first."""
        return min(max(self.decides_at - self.steps_before - self.steps_done, 0), self.remaining_steps)


@dataclass
class _Request:
    clock: ModelClock
    needs_generator: bool
    order: int
    needs_device: bool = True
    granted: threading.Event = field(default_factory=threading.Event)
    device: int | None = None


class DeviceScheduler:
    """``devices`` device slots shared by the models of a sweep, handed out longest remaining time first; on the CPU,
    device k is the core ``cores[k]`` (None, or ``pin=False``: the OS places the threads; ``lent``: and the cores
    idle worker processes lend this one), on CUDA the GPU ``gpus[k]``.

    Whenever a device comes free (or a model starts waiting), the dispatcher gives the free devices to the waiting
    models in order of remaining time and wakes only those.
    """

    def __init__(
        self,
        devices: int,
        cores: Sequence[int] | None = None,
        gpus: Sequence[torch.device] | None = None,
        ranking: Ranking = "end",
        pin: bool = True,
        lent: LentCores | None = None,
    ) -> None:
        if cores is not None and len(cores) < devices:
            raise ValueError(f"{devices} devices need as many cores; {list(cores)} were given.")
        if gpus is not None and len(gpus) != devices:
            raise ValueError(f"{devices} devices need as many GPUs; {list(gpus)} were given.")
        if ranking not in ("expected", "end"):
            raise ValueError(
                f'DeviceScheduler ranks models by "expected" remaining time or time to their "end", not {ranking!r}.'
            )
        self.devices, self.cores, self.gpus, self.ranking, self.pin = devices, cores, gpus, ranking, pin
        self.lent = lent
        self.spans: list[DeviceSpan] = []
        self._gpu_marks: list[tuple[DeviceSpan, torch.cuda.Event, torch.cuda.Event]] = []  # a turn's host span, events
        self._gpu_origins: dict[int, tuple[torch.cuda.Event, float]] = {}  # device -> an event and its host time
        self._free = list(range(devices))
        self._generator_holder: str | None = None  # the model whose requests hold torch's global generator
        self._generator_holds = 0  # how many of its requests hold it
        self._generator_kept: dict[str, _Request] = {}  # generator holds without a device (`hold_generator`)
        self.generator_device = gpus[0] if gpus is not None else torch.device("cpu")  # whose generators to swap
        self._process_random_state: list[torch.Tensor] = []  # the process's, while a model draws from its own
        self._waiting: list[_Request] = []
        self._clocks: dict[str, ModelClock] = {}
        self._lock = threading.Lock()
        self._arrivals = 0
        self._stopped: str | None = None
        self._hold_due: float | None = None  # when the devices held now are held no longer (`_dispatch_later`)
        self._hold_thread: threading.Thread | None = None  # which dispatches again then
        self._hold_changed = threading.Condition(self._lock)
        # Of each thread: ``.core``, the core it is pinned to (see `_on_device`); ``.turns``, model -> the turn it
        # holds a device for in this thread.
        self._thread = threading.local()
        self._holders: dict[int, str] = {}  # device -> the model whose turn it runs
        self._alone: str | None = None  # the model running alone (`alone`): no other model starts a turn
        self._waiting_alone: set[str] = set()  # models waiting to run alone (they compute nothing meanwhile)
        self._changed = threading.Condition(self._lock)  # a turn ended, or a model stopped running alone

    def add(self, name: str, size: int, random_state: list[torch.Tensor] | None = None) -> ModelClock:
        """Register a model by ``name`` (unique) with its size, for estimates until it has stepped, and the state
        (`generator_states`) that its draws start from (see module; None: it draws from the process's state)."""
        clock = self._clocks[name] = ModelClock(name, size, random_state=random_state)
        return clock

    def clock(self, name: str) -> ModelClock:
        return self._clocks[name]

    def random_state(self, name: str) -> list[torch.Tensor]:
        """The generator state ``name``'s model draws from next, read without waiting for the generator: the
        generator's own while the model holds it (or has no state of its own), else the state kept for it."""
        with self._lock:
            clock = self._clocks[name]
            if self._generator_holder == name or clock.random_state is None:
                return generator_states(self.generator_device)
            return [state.clone() for state in clock.random_state]

    # ------------------------------------------------------------------------------------ remaining time
    def remaining_s(self, clock: ModelClock) -> float:
        """The device time ``clock``'s model still needs as the scheduler ranks it (``ranking``): measured, or
        estimated from its size (see module)."""
        return self._remaining_s(clock, self._per_byte_step())

    def _per_byte_step(self) -> float:
        stepped = [c for c in self._clocks.values() if c.steps_done]
        return sum(c.stepped_s for c in stepped) / sum(c.size * c.steps_done for c in stepped) if stepped else 1.0

    def _remaining_s(self, clock: ModelClock, per_byte_step: float) -> float:
        per_step = clock.stepped_s / clock.steps_done if clock.steps_done else clock.size * per_byte_step
        under_way = round((clock.device_s - clock.setup_s - clock.stepped_s) / per_step) if per_step > 0 else 0
        to_end = max(clock.remaining_steps - under_way, 0)
        if self.ranking == "end":
            return to_end * per_step
        to_decision = max(clock.steps_to_decision - under_way, 0)
        return (to_decision + clock.goes_on * (to_end - to_decision)) * per_step

    def stepped(
        self,
        name: str,
        steps_done: int,
        total_steps: float,
        steps_before: int,
        decides_at: float = float("inf"),
        goes_on: float = 1.0,
    ) -> None:
        """Record a model's progress (after each optimizer step), and when the next decision that may end it early
        comes (``decides_at``, a global step) with the share of models that go on past it (``goes_on``)."""
        with self._lock:
            clock = self._clocks[name]
            clock.steps_done, clock.total_steps, clock.steps_before = steps_done, total_steps, steps_before
            clock.decides_at, clock.goes_on = decides_at, goes_on
            clock.stepped_s = clock.device_s - clock.setup_s

    def finished(self, name: str) -> None:
        """The model's fit has ended (done, failed or stopped): it asks for no more turns, and no longer holds the
        generator (a fit that ended before its teardown ran)."""
        self.release_generator(name)
        with self._lock:
            self._clocks[name].finished = True

    def stop(self, reason: str) -> None:
        """Stop the sweep: every model raises `SweepStopped` when it next asks for a turn."""
        with self._lock:
            self._stopped = reason
            for request in self._waiting:
                request.granted.set()

    def queue(self) -> list[str]:
        """The models waiting for a device, longest remaining time (next served) first."""
        with self._lock:
            return [r.clock.name for r in self._by_priority(self._per_byte_step())]

    def _by_priority(self, rate: float) -> list[_Request]:
        # Holds without a device first (see module), then longest remaining time, then earliest arrival.
        return sorted(self._waiting, key=lambda r: (r.needs_device, -self._remaining_s(r.clock, rate), r.order))

    # ------------------------------------------------------------------------------------------------ turns
    @contextmanager
    def turn(self, name: str, work: str, shard: int, training: bool = False, generator: bool = False) -> Iterator[bool]:
        """Wait for a device, run the block on it, give it back; yields whether the turn holds torch's global generator.

        Forward and backward turns of a model whose forward draws random numbers (or may: its first) hold the
        generator, as do turns asking for it (``generator``); other threads draw nothing from it meanwhile, except
        from outside their turns. A turn that a model takes inside one of its own, in the same thread, runs at once
        within it (and must not need the generator if that turn does not hold it).
        """
        clock = self._clocks[name]
        draws = clock.draws.get((shard, training)) if work in ("forward", "backward") else False
        in_turn: dict[str, _Request] = self._thread.__dict__.setdefault("turns", {})
        outer = in_turn.get(name)
        if outer is not None:  # within the model's own turn (a whole step's: see module)
            with self._draws_measured(clock, work, shard, training, outer.device):
                if (generator or draws is not False) and not outer.needs_generator:
                    raise RuntimeError(
                        f"{name}'s {work} of shard {shard} needs torch's global generator, which the turn it runs "
                        "in does not hold: ask for it (`generator=True`) when taking the outer turn."
                    )
                yield outer.needs_generator
            return
        request = self._wait(clock, needs_generator=generator or draws is not False)
        assert request.device is not None
        in_turn[name] = request
        start = time.perf_counter()
        events = None
        try:
            with self._on_device(request.device), self._draws_measured(clock, work, shard, training, request.device):
                if self.gpus is not None:
                    events = self._gpu_event(request.device), torch.cuda.Event(enable_timing=True)
                try:
                    yield request.needs_generator
                finally:
                    if events is not None:
                        events[1].record()
        finally:
            end = time.perf_counter()
            del in_turn[name]
            with self._lock:
                clock.device_s += end - start
                clock.setup_s += end - start if work == "set-up" else 0.0
                clock.turns -= 1
                clock.released_s = end
                span = DeviceSpan(request.device, name, work, shard, start, end)
                self.spans.append(span)
                if events is not None:
                    self._gpu_marks.append((span, *events))
                self._release(request)
                self._changed.notify_all()
                self._dispatch()

    @contextmanager
    def _draws_measured(
        self, clock: ModelClock, work: str, shard: int, training: bool, device: int | None
    ) -> Iterator[None]:
        """Find out in the block whether ``shard``'s forward draws random numbers, if not known yet."""
        if work != "forward" or clock.draws.get((shard, training), None) is not None:
            yield
            return
        on = self.gpus[device] if self.gpus is not None and device is not None else torch.device("cpu")
        before = generator_states(on)
        try:
            yield
        finally:
            clock.draws[(shard, training)] = states_differ(before, generator_states(on))

    def _gpu_event(self, device: int) -> torch.cuda.Event:
        """An event recorded now on the current stream of GPU ``device`` (its first turn's also gives the device's
        origin: recorded, waited for, and taken as the host's time then)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if device not in self._gpu_origins:
            event.synchronize()
            self._gpu_origins[device] = event, time.perf_counter()
        return event

    def gpu_spans(self) -> list[DeviceSpan]:
        """When each turn's work ran on its GPU (measured by CUDA events; waits for the work to end), on the clock of
        `spans`; none on the CPU."""
        spans = []
        for span, start, end in list(self._gpu_marks):
            end.synchronize()
            origin, origin_s = self._gpu_origins[span.device]
            start_s = origin_s + origin.elapsed_time(start) / 1e3
            spans.append(replace(span, start_s=start_s, end_s=origin_s + origin.elapsed_time(end) / 1e3))
        return spans

    @contextmanager
    def _on_device(self, device: int) -> Iterator[None]:
        """Run the block on ``device`` (see module): the current GPU, or with the thread pinned to the device's core
        if devices are cores."""
        if self.gpus is not None:
            with torch.cuda.device(self.gpus[device]):
                yield
            return
        if self.cores is None or not self.pin:
            yield
            return
        if self.lent is not None:  # one device, in a worker process: its core and those lent to it
            self.lent.use()
        elif getattr(self._thread, "core", None) != self.cores[device]:
            os.sched_setaffinity(0, {self.cores[device]})
            self._thread.core = self.cores[device]
        yield

    @contextmanager
    def alone(self, name: str) -> Iterator[None]:
        """Run the block while no other model is in a turn (see module); ``name``'s own turn may go on."""
        with self._changed:
            self._waiting_alone.add(name)
            self._changed.wait_for(lambda: self._alone is None or self._stopped is not None)
            self._alone = name
            self._waiting_alone.discard(name)
            self._changed.wait_for(lambda: not self._others_computing(name) or self._stopped is not None)
        try:
            yield
        finally:
            with self._changed:
                self._alone = None
                self._changed.notify_all()
                self._dispatch()

    def _others_computing(self, name: str) -> bool:
        return any(model != name and model not in self._waiting_alone for model in self._holders.values())

    def hold_generator(self, name: str) -> None:
        """Wait until no other model holds torch's global generator, then hold it for ``name``'s model, without a
        device, until `release_generator`; the model's own turns go on meanwhile."""
        request = self._wait(self._clocks[name], needs_generator=True, needs_device=False)
        with self._lock:
            self._generator_kept[name] = request

    def release_generator(self, name: str) -> None:
        """End ``name``'s `hold_generator`, if it holds the generator."""
        with self._lock:
            request = self._generator_kept.pop(name, None)
            if request is not None:
                self._release(request)
                self._dispatch()

    @contextmanager
    def generator_held(self, holder: str) -> Iterator[None]:
        """Run the block holding torch's global generator for ``holder``: a model of the sweep, which then draws from
        its own state (see module), or another holder, which draws from the process's (the sweep's own thread
        building a model while others train: its seeded initialization must not interleave with a model's draws,
        nor with Lightning restoring the generator's state after a sanity check). Once the sweep is stopped the
        block runs without the hold: no model draws any more, and the model built then learns of the stop at its
        first turn, as the others do. Inside a turn of the model's own (a batch read in its step), the block runs in
        that turn, which holds the generator or not: waiting for it there, holding a device, could wait forever."""
        if holder in self._thread.__dict__.get("turns", {}):
            yield
            return
        try:
            clock = self._clocks.get(holder) or ModelClock(holder, 0)
            request = self._wait(clock, needs_generator=True, needs_device=False)
        except SweepStopped:
            yield
            return
        try:
            yield
        finally:
            with self._lock:
                self._release(request)
                self._dispatch()

    def _wait(self, clock: ModelClock, needs_generator: bool, needs_device: bool = True) -> _Request:
        with self._lock:
            if self._stopped is not None:
                raise SweepStopped(f"the sweep was stopped ({self._stopped})")
            self._arrivals += 1
            clock.turns += int(needs_device)
            request = _Request(clock, needs_generator, self._arrivals, needs_device)
            self._waiting.append(request)
            self._dispatch()
        request.granted.wait()
        with self._lock:
            if self._stopped is None:
                return request
            clock.turns -= int(needs_device)
            if request in self._waiting:
                self._waiting.remove(request)
            else:
                self._release(request)
                self._dispatch()
        raise SweepStopped(f"the sweep was stopped ({self._stopped})")

    def _dispatch_later(self) -> None:
        """Dispatch again once the devices held now are held no longer (if their models have not come back), on one
        thread that lives as long as holds keep coming (a thread started for each hold cost more than a short turn)."""
        if self._hold_due is not None:
            return
        self._hold_due = time.perf_counter() + HOLD_S
        if self._hold_thread is None:
            self._hold_thread = threading.Thread(target=self._end_holds, name="sweep holds", daemon=True)
            self._hold_thread.start()
        else:
            self._hold_changed.notify()

    def _end_holds(self) -> None:
        """Dispatch as each hold ends; stop after a second without holds."""
        with self._lock:
            while True:
                if self._hold_due is None:
                    self._hold_changed.wait(timeout=1.0)
                    if self._hold_due is None:
                        self._hold_thread = None
                        return
                    continue
                delay = self._hold_due - time.perf_counter()
                if delay > 0:
                    self._hold_changed.wait(timeout=delay)
                    continue
                self._hold_due = None
                self._dispatch()

    def _release(self, request: _Request) -> None:
        if request.device is not None:
            self._free.append(request.device)
            del self._holders[request.device]
        if request.needs_generator:
            self._generator_holds -= 1
            if not self._generator_holds:
                self._generator_holder = None
                if request.clock.random_state is not None:  # the model's own state, kept; the process's, put back
                    request.clock.random_state = generator_states(self.generator_device)
                    set_generator_states(self._process_random_state, self.generator_device)

    def _dispatch(self) -> None:
        """Give the free devices to the waiting requests, longest remaining time first (earlier arrivals first among
        equals; one model at a time holds the generator; while a model runs `alone`, to none but it), except those
        held for the D longest models that are between two turns; wake those served."""
        if self._stopped is not None or not self._waiting:  # (a turn given back with none waiting: the usual case)
            return
        rate, now = self._per_byte_step(), time.perf_counter()
        running = [c for c in self._clocks.values() if not c.finished]
        longest = sorted(running, key=lambda c: -self._remaining_s(c, rate))[: self.devices]
        held = sum(1 for c in longest if c.turns == 0 and now - c.released_s < HOLD_S)
        for request in self._by_priority(rate):
            if request.needs_generator and self._generator_holder not in (None, request.clock.name):
                continue
            if request.needs_device:
                if not self._free or self._alone not in (None, request.clock.name):
                    continue
                if len(self._free) <= held and not any(request.clock is c for c in longest):
                    self._dispatch_later()
                    continue
                # The device of its last turn if free: its thread is pinned there already (see `_on_device`).
                last = request.clock.device
                request.device = last if last in self._free else self._free[0]
                self._free.remove(request.device)
                request.clock.device = request.device
                self._holders[request.device] = request.clock.name
            if request.needs_generator:
                if self._generator_holder is None and request.clock.random_state is not None:
                    self._process_random_state = generator_states(self.generator_device)
                    set_generator_states(request.clock.random_state, self.generator_device)
                self._generator_holder = request.clock.name
                self._generator_holds += 1
            self._waiting.remove(request)
            request.granted.set()
