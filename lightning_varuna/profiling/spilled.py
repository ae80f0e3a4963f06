"""Predict the step time and memory of training spilled (`SpillingStrategy`, one device) from a profile.

The shards are the ones the strategy itself would plan: the profiled segments' memory packed by `pack_shards` for
the budget, so the prediction knows which shards compute their forward again in backward and which neighbours are
fetched while the other computes. The step is then simulated as `ShardedModel` runs it, with one compute stream and
the store's one I/O queue (spills and fetches in the order asked, each taking the profile's measured time for its
bytes on the tier):

- forward, shard by shard: a shard's parameters arrive (fetched ahead, if it fits beside the one before), the next
  shard's fetch starts, the shard computes; it is then dropped (parameters unchanged: nothing written);
- backward, in reverse: the shard's parameters and optimizer state arrive, the previous shard's fetch starts, the
  shard computes its forward again (unless it kept its activations) and its backward, steps its optimizer, and its
  parameters and state are spilled;
- or, with the optimizer in a pass of its own (clipping by the norm over all shards), backward spills each shard's
  gradients, and the pass fetches parameters, gradients and state of each shard and spills parameters and state.

The compute takes the profiled times, times the tier's calibrated ``compute_factor`` (`calibrate_spilled`).

Memory: what stays on the device throughout (activations at CutPoints with their gradients, buffers, tied
parameters), the activations the shards that keep them hold, and the two largest neighbours on the device together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_varuna.partition.packing import Packing, SegmentMemory, format_bytes, pack_shards
from lightning_varuna.profiling.profile import ModelProfile, RuntimeOverheads, SpillCosts
from lightning_varuna.profiling.trace import Span, chrome_trace

__all__ = ["SpilledConfig", "SpilledPrediction", "segment_memory", "simulate_spilled"]

TIERS = ("host", "disk")
_COMPUTE, _IO = 0, 1  # the timeline's lanes


@dataclass(frozen=True)
class SpilledConfig:
    """Train on one device, the model's shards taking turns on it within ``memory_budget`` bytes, spilled to
    ``tier`` ("host" memory or "disk"), one batch of ``global_batch_size`` rows a step."""

    global_batch_size: int
    memory_budget: int
    tier: str = "disk"
    prefetch: bool = True
    step_in_backward: bool = True  # each shard steps after its backward (no clipping by the norm over all shards)

    world_size = 1
    processes_per_node = 1

    def __str__(self) -> str:
        return f"spilled to {self.tier}, 1 device, budget {format_bytes(self.memory_budget)}"


@dataclass
class SpilledPrediction:
    """One predicted spilled step; the times add up to ``step_s``: ``compute_s + wait_s + overhead_s``."""

    config: SpilledConfig
    step_s: float
    forward_s: float  # the shards' forwards
    recompute_s: float  # the forwards computed again in backward
    backward_s: float
    optimizer_s: float
    wait_s: float  # the compute stream waiting for a fetch
    overhead_s: float  # calibrated per-step costs of one process (the user's step, Lightning's hooks)
    bytes_read: int
    bytes_written: int
    memory_bytes: list[int]  # one device: what it holds at the peak
    shards: list[list[int]]  # the segments of each shard
    recomputed: list[int]  # the shards that compute their forward again in backward
    timeline: list[Span] = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.recompute_s + self.backward_s + self.optimizer_s

    def chrome_trace(self) -> str:
        """The step as a Chrome / Perfetto trace: compute on stage 0, the store's I/O on stage 1."""
        return chrome_trace(self.timeline, f"predicted: {self.config}")


def segment_memory(profile: ModelProfile, rows: int) -> tuple[list[SegmentMemory], int]:
    """Each segment's needs on the device at ``rows`` rows, counted as SpillingStrategy counts them at set-up (a
    parameter with its gradient and two optimizer tensors; what autograd keeps in its forward), and the bytes that
    stay on the device throughout: buffers, parameters used by several segments (with their gradients and state),
    the activations at CutPoints with their gradients."""
    threads = profile.threads_per_process(1)
    shared = _shared_parameters(profile)
    memory = []
    for i, segment in enumerate(profile.segments):
        own = sum(b for name, b in segment.parameters.items() if name not in shared)
        memory.append(SegmentMemory(segment.name, 4 * own, profile.timing(i, threads, rows).activation_bytes))
    boundaries = sum(profile.timing(i, threads, rows).output_bytes for i in range(len(profile.segments) - 1))
    kept = profile.buffer_bytes + 4 * sum(shared.values()) + 2 * boundaries
    return memory, kept


def simulate_spilled(profile: ModelProfile, config: SpilledConfig, *, timeline: bool = False) -> SpilledPrediction:
    """Predict one spilled step of ``config`` (see the module's docstring).

    Raises:
        ValueError: the budget cannot train the model (the message names the smallest that can).
        KeyError: the profile has no measurement of ``config.tier`` (profile with `lightning-varuna profile`).
    """
    rows = config.global_batch_size
    threads = profile.threads_per_process(1)
    memory, kept = segment_memory(profile, rows)
    # As the strategy plans it: a model that fits the room whole stays on the device, nothing fetched beside it.
    fits_whole = sum(segment.need for segment in memory) <= config.memory_budget - kept
    packing = pack_shards(memory, config.memory_budget, kept, config.prefetch and not fits_whole, training=True)
    timings = [profile.timing(i, threads, rows) for i in range(len(profile.segments))]
    shared = _shared_parameters(profile)
    shards = packing.shards
    factor = profile.spill[config.tier].compute_factor  # calibrated (1 until then)
    forward = [factor * sum(timings[s].forward_s for s in shard) for shard in shards]
    backward = [factor * sum(timings[s].backward_s for s in shard) for shard in shards]
    optimizer = [factor * sum(profile.optimizer_step_s(s, threads) for s in shard) for shard in shards]
    params = [sum(_own_bytes(profile, s, shared) for s in shard) for shard in shards]
    state = [sum(_own_state_bytes(profile, s, shared) for s in shard) for shard in shards]
    part_bytes = {"params": params, "grads": params, "state": state}
    run = _Run(profile.spill[config.tier], packing, part_bytes, stays=len(shards) == 1)
    _walk_step(run, config, packing, forward, backward, optimizer)  # leaves the store's queue as a step leaves it
    run.start_step(timeline)
    recompute_s = _walk_step(run, config, packing, forward, backward, optimizer)
    overheads = profile.overheads.get(1, RuntimeOverheads())
    # A cost per action below the profile (negative) takes at most the compute away, as in the pipeline simulator.
    overhead_s = (
        overheads.step_s + max(overheads.forward(rows), -sum(forward)) + max(overheads.backward(rows), -sum(backward))
    )
    step_s = run.now - run.started + overhead_s
    pairs = [a + b for a, b, fits in _neighbours(memory, packing) if fits]
    alone = [sum(memory[s].need for s in shard) for shard in shards]
    peak = kept + packing.kept_activation_bytes + max(pairs + alone)
    return SpilledPrediction(
        config=config,
        step_s=step_s,
        forward_s=sum(forward),
        recompute_s=recompute_s,
        backward_s=sum(backward),
        optimizer_s=sum(optimizer),
        wait_s=run.waited,
        overhead_s=overhead_s,
        bytes_read=run.bytes_read,
        bytes_written=run.bytes_written,
        memory_bytes=[peak],
        shards=shards,
        recomputed=[k for k in range(len(shards) - 1) if not packing.keeps[k]],
        timeline=run.spans,
    )


def _walk_step(
    run: _Run,
    config: SpilledConfig,
    packing: Packing,
    forward: list[float],
    backward: list[float],
    optimizer: list[float],
) -> float:
    """One step as `ShardedModel` runs it (see the module's docstring); returns the seconds of recomputed forwards."""
    K = len(packing.shards)
    for k in range(K):
        run.bring(k, ())
        run.prefetch(k, k + 1, ())
        run.compute(f"forward {k}", forward[k])
        if k < K - 1:
            run.evict(k, ())
    recompute_s = 0.0
    with_state = ("state",) if config.step_in_backward else ()
    for k in reversed(range(K)):
        run.bring(k, with_state)
        run.prefetch(k, k - 1, with_state)
        if k < K - 1 and not packing.keeps[k]:
            run.compute(f"recompute {k}", forward[k])
            recompute_s += forward[k]
        run.compute(f"backward {k}", backward[k])
        if config.step_in_backward:
            run.compute(f"optimizer {k}", optimizer[k])
            run.evict(k, ("params", "state"))  # the gradients were consumed by the step: dropped
        else:
            run.evict(k, ("grads",))
    if not config.step_in_backward:  # the optimizer's own pass
        for k in range(K):
            run.bring(k, ("grads", "state"))
            run.prefetch(k, k + 1, ("grads", "state"))
            run.compute(f"optimizer {k}", optimizer[k])
            run.evict(k, ("params", "state"))
    return recompute_s


class _Run:
    """The compute stream's clock and the store's I/O queue (one thread: one transfer at a time, in order). A model
    in one shard stays on the device: nothing moves."""

    def __init__(self, costs: SpillCosts, packing: Packing, part_bytes: dict[str, list[int]], stays: bool) -> None:
        self.costs, self.packing, self.part_bytes, self.stays = costs, packing, part_bytes, stays
        self.now = self.io_free = self.started = self.waited = 0.0
        self.bytes_read = self.bytes_written = 0
        self.loaded: set[int] = set()
        self.arriving: dict[tuple[int, str], float] = {}  # fetches under way: when each part is on the device
        self.timeline = False
        self.spans: list[Span] = []

    def start_step(self, timeline: bool) -> None:
        """Count from here (the waits, bytes and spans of the step that starts now)."""
        self.started, self.waited, self.bytes_read, self.bytes_written = self.now, 0.0, 0, 0
        self.timeline, self.spans = timeline, []

    def compute(self, name: str, seconds: float) -> None:
        self._span(_COMPUTE, name, self.now, self.now + seconds)
        self.now += seconds

    def bring(self, shard: int, parts: tuple[str, ...]) -> None:
        """Wait for the parts of ``shard`` (its parameters and ``parts``) that are not on the device (fetched now if no
        fetch is under way)."""
        if self.stays:
            return
        wanted = parts if shard in self.loaded else ("params", *parts)
        for part in wanted:
            arrives = self.arriving.pop((shard, part), None)
            if arrives is None:
                arrives = self._read(shard, part)
            if arrives > self.now:
                self.waited += arrives - self.now
                self.now = arrives
        self.loaded.add(shard)

    def prefetch(self, current: int, shard: int, parts: tuple[str, ...]) -> None:
        """Start fetching ``shard`` (its parameters and ``parts``) if there is one, it is not on the device and it fits
        beside ``current``."""
        if self.stays or not 0 <= shard < len(self.packing.shards) or shard in self.loaded:
            return
        if self.packing.overlaps[min(current, shard)]:
            for part in ("params", *parts):
                if (shard, part) not in self.arriving:
                    self.arriving[(shard, part)] = self._read(shard, part)

    def evict(self, shard: int, parts: tuple[str, ...]) -> None:
        """Spill the ``parts`` of ``shard`` (written in the background) and let it go."""
        if self.stays:
            return
        for part in parts:
            nbytes = self.part_bytes[part][shard]
            self._transfer(f"write {part} {shard}", nbytes, self.costs.write(nbytes))
            self.bytes_written += nbytes
        self.loaded.discard(shard)

    def _read(self, shard: int, part: str) -> float:
        nbytes = self.part_bytes[part][shard]
        self.bytes_read += nbytes
        return self._transfer(f"read {part} {shard}", nbytes, self.costs.read(nbytes))

    def _transfer(self, name: str, nbytes: int, seconds: float) -> float:
        start = max(self.now, self.io_free)
        self.io_free = start + (seconds if nbytes else 0.0)
        self._span(_IO, name, start, self.io_free)
        return self.io_free

    def _span(self, lane: int, name: str, start: float, end: float) -> None:
        if self.timeline and end > start:
            self.spans.append(Span(lane, name, start - self.started, end - self.started))


def _neighbours(memory: list[SegmentMemory], packing: Packing) -> list[tuple[int, int, bool]]:
    needs = [sum(memory[s].need for s in shard) for shard in packing.shards]
    return [(a, b, fits) for a, b, fits in zip(needs, needs[1:], packing.overlaps)]


def _shared_parameters(profile: ModelProfile) -> dict[str, int]:
    """The parameters more than one segment uses (tied weights), with their bytes: they stay on the device."""
    uses: dict[str, int] = {}
    for segment in profile.segments:
        for name in segment.parameters:
            uses[name] = uses.get(name, 0) + 1
    return {
        name: next(s.parameters[name] for s in profile.segments if name in s.parameters)
        for name, n in uses.items()
        if n > 1
    }


def _own_bytes(profile: ModelProfile, segment: int, shared: dict[str, int]) -> int:
    return sum(b for name, b in profile.segments[segment].parameters.items() if name not in shared)


def _own_state_bytes(profile: ModelProfile, segment: int, shared: dict[str, int]) -> int:
    """The optimizer state of the segment's own parameters (the profile measured it for all the segment uses)."""
    every = sum(profile.segments[segment].parameters.values())
    own = _own_bytes(profile, segment, shared)
    return round(profile.segments[segment].optimizer_bytes * own / every) if every else 0
