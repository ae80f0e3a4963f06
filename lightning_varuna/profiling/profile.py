"""What the profiler measures, as plain data that reads and writes as human-readable JSON at an fsspec URL."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_varuna.storage import Storage

__all__ = ["LinearCost", "ModelProfile", "ProfiledSegment", "RuntimeOverheads", "SegmentTiming", "SpillCosts"]


def segment_costs(timings: list[SegmentTiming]) -> list[float]:
    """Forward + backward seconds of each segment: what the stages are balanced by."""
    return [t.forward_s + t.backward_s for t in timings]


@dataclass
class SegmentTiming:
    """One segment at one micro-batch size and thread count."""

    forward_s: float  # forward keeping activations for backward (a recompute costs the same)
    forward_no_grad_s: float  # forward without keeping them (Varuna's first forward on non-last stages)
    backward_s: float
    activation_bytes: int  # what autograd saves for backward during the segment's forward
    output_bytes: int  # the activation at the CutPoint that closes the segment (0 for the last segment)
    # The backward split in two (zero-bubble): its input-gradient part and its weight part, as shares of
    # ``backward_s`` (None where not profiled)
    split_shares: tuple[float, float] | None = None


@dataclass
class ProfiledSegment:
    """The model between two CutPoints: its parameters, optimizer state and timings."""

    name: str  # the CutPoint that closes the segment, or "<output>" for the last one
    fingerprint: str  # changes when the segment's modules or parameter shapes change
    parameters: dict[str, int]  # bytes of each parameter it uses (a tied weight appears in each segment using it)
    optimizer_bytes: int  # optimizer state after one step
    optimizer_step_s: dict[int, float] = field(default_factory=dict)  # by thread count
    timings: dict[int, dict[int, SegmentTiming]] = field(default_factory=dict)  # [threads][micro_batch_size]


@dataclass
class LinearCost:
    """Seconds to move ``n`` bytes: between measured sizes, the line through the two nearest samples; below them,
    the smallest sample's time; above them, ``latency_s + n / bytes_per_s`` fitted to all samples (small
    transfers often cost more than a line says)."""

    latency_s: float
    bytes_per_s: float
    samples: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds) measured, by size

    def __call__(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        points = self.samples
        if len(points) >= 2 and points[0][0] <= nbytes <= points[-1][0]:
            for (b0, s0), (b1, s1) in zip(points, points[1:]):
                if nbytes <= b1:
                    return s0 + (s1 - s0) * (nbytes - b0) / (b1 - b0) if b1 > b0 else s1
        if points and nbytes < points[0][0]:
            return points[0][1]
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> LinearCost:
        """Keep the samples and fit a line to them (latency and inverse bandwidth kept non-negative)."""
        samples = sorted((int(b), float(s)) for b, s in samples)
        n = len(samples)
        xs, ys = [float(b) for b, _ in samples], [s for _, s in samples]
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        var = sum((x - mean_x) ** 2 for x in xs)
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var, 1e-15) if var else 1e-15
        latency = max(mean_y - slope * mean_x, 0.0)
        return cls(latency_s=latency, bytes_per_s=1.0 / slope, samples=samples)


@dataclass
class SpillCosts:
    """Seconds to spill a part of a shard (its parameters, gradients or optimizer state: one file on the disk tier)
    and to fetch it back, by its bytes, measured with SpillingStrategy's own store in its pattern (a part rewritten
    in place and dropped from the page cache, then read into a buffer used again)."""

    read: LinearCost
    write: LinearCost
    # How much longer the shards compute than profiled while spilling to this tier, learned from a measured spilled
    # step (`calibrate_spilled`); e.g. on the CPU the disk tier returns freed memory to the system at once, so each
    # activation's pages are faulted in anew.
    compute_factor: float = 1.0


@dataclass
class RuntimeOverheads:
    """What a real pipelined step costs beyond the profiled segments, learned from measured steps (`calibrate`):
    the user's step and the runtime's bookkeeping around each forward and backward (at each calibrated micro-batch
    size; between them, linear; beyond them, from the nearest along the slope of a line fitted to all; negative at a
    size where the profile over-estimates the compute), the delay of
    a message over its measured transfer time, the per-step work after the last backward (sharing the logged values,
    Lightning's hooks), with replicas, how long the gradient all-reduce waits for the slowest one, as a share of the
    pipeline's length (replicas sharing cores drift apart), and how many times its profiled time a weight pass of a
    split backward takes when it runs deferred behind other work (learned from a run whose schedule splits the
    backward; None without one: as profiled), how many times its profiled time the optimizer step takes (the
    profile times it alone, not beside the step's other ranks; None: as profiled), and what the step's reduction
    (of the gradients over the replicas, of tied weights over their stages) costs a step beyond its measured
    transfer (None: as profiled, no measured step reduced anything)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    message_s: float = 0.0
    step_s: float = 0.0
    forward_per_row_s: float = 0.0
    backward_per_row_s: float = 0.0
    replica_lag: float = 0.0
    weight_factor: float | None = None
    optimizer_factor: float | None = None
    reduce_s: float | None = None
    # (rows, per forward s, per backward s) as calibrated at each micro-batch size, by rows; empty: the line alone
    by_rows: list[tuple[int, float, float]] = field(default_factory=list)

    def __str__(self) -> str:
        if self.by_rows:
            per_action = ", ".join(f"{f * 1e3:.2f} + {b * 1e3:.2f} ms at {rows}" for rows, f, b in self.by_rows)
            per_action = f"per forward + backward {per_action} row(s)"
        else:
            per_action = (
                f"per forward {self.forward_s * 1e3:.2f} ms + {self.forward_per_row_s * 1e3:.2f} ms per row, per "
                f"backward {self.backward_s * 1e3:.2f} ms + {self.backward_per_row_s * 1e3:.2f} ms per row"
            )
        return (
            f"{per_action}, per message {self.message_s * 1e3:.2f} ms, per step {self.step_s * 1e3:.2f} ms, waiting "
            f"for replicas {self.replica_lag:.1%} of the pipeline, weight passes "
            + ("as profiled" if self.weight_factor is None else f"{self.weight_factor:.2f}x their profiled time")
            + ", the optimizer step "
            + ("as profiled" if self.optimizer_factor is None else f"{self.optimizer_factor:.2f}x its profiled time")
            + ", the reduction "
            + ("as profiled" if self.reduce_s is None else f"{self.reduce_s * 1e3:+.2f} ms a step")
        )

    def forward(self, rows: int) -> float:
        return self._per_action(rows, 1, self.forward_s, self.forward_per_row_s)

    def backward(self, rows: int) -> float:
        return self._per_action(rows, 2, self.backward_s, self.backward_per_row_s)

    def _per_action(self, rows: int, column: int, constant_s: float, per_row_s: float) -> float:
        """The cost at ``rows``: between two calibrated sizes, on the line through them; beyond them, from the
        nearest along the slope of the fitted line (without a table, that line)."""
        table = [(entry[0], entry[column]) for entry in self.by_rows]
        if not table:
            return constant_s + rows * per_row_s
        for (r0, s0), (r1, s1) in zip(table, table[1:]):
            if r0 <= rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        nearest_rows, nearest_s = table[0] if rows < table[0][0] else table[-1]
        return nearest_s + (rows - nearest_rows) * per_row_s


@dataclass
class ModelProfile:
    """A model's segments and the network of the machines it will run on, as the simulator needs them."""

    model: str
    device: str
    cores_per_node: int  # CPU cores of a node (how many compute streams run at full speed on CPU)
    segments: list[ProfiledSegment]
    # Measured while ``processes`` ranks of one node run at once (they share its cores): one-way send time by
    # processes; all-reduce time by processes and group width (all groups of that width reducing together).
    p2p: dict[int, LinearCost] = field(default_factory=dict)
    allreduce: dict[int, dict[int, LinearCost]] = field(default_factory=dict)
    # Seconds to broadcast a small Python object (a step's logged values) in groups of each width, by processes.
    object_broadcast: dict[int, dict[int, float]] = field(default_factory=dict)
    # Learned from measured steps, by processes per node (see `calibrate`); none: the simulator adds nothing.
    overheads: dict[int, RuntimeOverheads] = field(default_factory=dict)
    # Spilling's tiers ("host", "disk"), measured with its store (`lightning-varuna profile`); none: no spilled
    # configuration can be predicted.
    spill: dict[str, SpillCosts] = field(default_factory=dict)
    buffer_bytes: int = 0  # the model's buffers: they stay on the device of a spilled model throughout
    version: int = 1

    def threads_per_process(self, processes_per_node: int) -> int:
        """The CPU threads each process gets when ``processes_per_node`` share a node (as Lightning sets them)."""
        return max(1, self.cores_per_node // processes_per_node)

    @property
    def cutpoints(self) -> list[str]:
        return [s.name for s in self.segments[:-1]]

    @property
    def micro_batch_sizes(self) -> list[int]:
        sizes = {mb for s in self.segments for by_mb in s.timings.values() for mb in by_mb}
        return sorted(sizes)

    @property
    def thread_counts(self) -> list[int]:
        return sorted({t for s in self.segments for t in s.timings})

    def timing(self, segment: int, threads: int, micro_batch_size: int) -> SegmentTiming:
        """The timing of a segment, at the nearest profiled thread count, scaled linearly between batch sizes."""
        by_threads = self.segments[segment].timings
        by_mb = by_threads[_nearest_threads(by_threads, threads)]
        if micro_batch_size in by_mb:
            return by_mb[micro_batch_size]
        sizes = sorted(by_mb)
        below = max((s for s in sizes if s < micro_batch_size), default=sizes[0])
        above = min((s for s in sizes if s > micro_batch_size), default=sizes[-1])
        if below == above:
            return _scaled(by_mb[below], micro_batch_size / below)
        w = (micro_batch_size - below) / (above - below)
        return _interpolated(by_mb[below], by_mb[above], w)

    def segment_costs(self, threads: int, micro_batch_size: int) -> list[float]:
        """Forward + backward seconds of each segment: what the stages are balanced by."""
        return segment_costs([self.timing(i, threads, micro_batch_size) for i in range(len(self.segments))])

    def optimizer_step_s(self, segment: int, threads: int) -> float:
        """The optimizer step time of a segment's parameters at the nearest profiled thread count (0 if none)."""
        by_threads = self.segments[segment].optimizer_step_s
        return by_threads[_nearest_threads(by_threads, threads)] if by_threads else 0.0

    # -------------------------------------------------------------------------------------------- storage
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        raw = json.loads(text)
        if raw.get("version") != 1:
            raise ValueError(f"Profile version {raw.get('version')!r} is not supported; profile the model again.")
        segments = [
            ProfiledSegment(
                name=s["name"],
                fingerprint=s["fingerprint"],
                parameters=s["parameters"],
                optimizer_bytes=s["optimizer_bytes"],
                optimizer_step_s={int(t): v for t, v in s["optimizer_step_s"].items()},
                timings={int(t): _timings_by_size(by_mb) for t, by_mb in s["timings"].items()},
            )
            for s in raw["segments"]
        ]
        return cls(
            model=raw["model"],
            device=raw["device"],
            cores_per_node=raw["cores_per_node"],
            segments=segments,
            p2p={int(n): _linear(v) for n, v in raw["p2p"].items()},
            allreduce={int(n): {int(d): _linear(v) for d, v in by_d.items()} for n, by_d in raw["allreduce"].items()},
            object_broadcast={
                int(n): {int(d): v for d, v in by_d.items()} for n, by_d in raw.get("object_broadcast", {}).items()
            },
            overheads={int(n): _overheads(v) for n, v in raw.get("overheads", {}).items()},
            spill={
                tier: SpillCosts(_linear(v["read"]), _linear(v["write"]), v.get("compute_factor", 1.0))
                for tier, v in raw.get("spill", {}).items()
            },
            buffer_bytes=raw.get("buffer_bytes", 0),
        )

    def save(self, url: str, storage: Storage | None = None) -> None:
        (storage or Storage()).write_bytes(url, self.to_json().encode())

    @classmethod
    def load(cls, url: str, storage: Storage | None = None) -> ModelProfile:
        return cls.from_json((storage or Storage()).read_bytes(url).decode())


def _nearest_threads(measured: dict[int, Any], threads: int) -> int:
    """The measured thread count closest to ``threads`` (the larger one on a tie)."""
    return min(measured, key=lambda t: (abs(t - threads), -t))


def _timings_by_size(raw: dict[str, Any]) -> dict[int, SegmentTiming]:
    timings = {}
    for mb, timing in raw.items():
        split = timing.get("split_shares")  # a list in JSON
        timings[int(mb)] = SegmentTiming(**{**timing, "split_shares": tuple(split) if split else None})
    return timings


def _overheads(raw: dict[str, Any]) -> RuntimeOverheads:
    return RuntimeOverheads(**{**raw, "by_rows": [(int(r), f, b) for r, f, b in raw.get("by_rows", [])]})


def _linear(raw: dict[str, Any]) -> LinearCost:
    return LinearCost(raw["latency_s"], raw["bytes_per_s"], [tuple(s) for s in raw.get("samples", [])])


def _interpolated(a: SegmentTiming, b: SegmentTiming, w: float) -> SegmentTiming:
    def mix(x: float, y: float) -> float:
        return x + (y - x) * w

    split_a, split_b = a.split_shares, b.split_shares
    return SegmentTiming(
        forward_s=mix(a.forward_s, b.forward_s),
        forward_no_grad_s=mix(a.forward_no_grad_s, b.forward_no_grad_s),
        backward_s=mix(a.backward_s, b.backward_s),
        activation_bytes=round(mix(a.activation_bytes, b.activation_bytes)),
        output_bytes=round(mix(a.output_bytes, b.output_bytes)),
        split_shares=(mix(split_a[0], split_b[0]), mix(split_a[1], split_b[1])) if split_a and split_b else None,
    )


def _scaled(a: SegmentTiming, factor: float) -> SegmentTiming:
    return replace(
        a,
        forward_s=a.forward_s * factor,
        forward_no_grad_s=a.forward_no_grad_s * factor,
        backward_s=a.backward_s * factor,
        activation_bytes=round(a.activation_bytes * factor),
        output_bytes=round(a.output_bytes * factor),
    )
