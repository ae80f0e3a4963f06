"""Write pipeline timelines (predicted or measured) as Chrome / Perfetto trace files."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_varuna.pipeline.schedules import Action, Phase

__all__ = ["Span", "chrome_trace", "read_chrome_trace", "work_of"]


@dataclass(frozen=True)
class Span:
    """One piece of work on one stage of one replica during a training step (seconds)."""

    stage: int  # the pipeline rank's position (its stage, with one stage per rank)
    work: Action | str  # a schedule action (F3, R3, B3, W3; 2F3 on a rank of several stages), or "all-reduce", ...
    start_s: float
    end_s: float
    replica: int = 0
    step: int = 0  # the training step, when a trace holds several

    @property
    def name(self) -> str:
        return str(self.work)

    @property
    def phase(self) -> Phase | None:
        """The phase of a schedule action; None for other work."""
        return self.work.phase if isinstance(self.work, Action) else None


def work_of(name: str) -> Action | str:
    """The action a span's name prints (``"B3"``), or the name itself for other work (``"optimizer"``)."""
    return Action.parse(name) if re.fullmatch(f"\\d*[{''.join(phase.value for phase in Phase)}]\\d+", name) else name


def chrome_trace(spans: Iterable[Span], title: str, metadata: dict[str, Any] | None = None) -> str:
    """A trace with one process per replica and one thread per stage; open it in ui.perfetto.dev or
    chrome://tracing. Times start at the earliest span; ``metadata`` goes into the trace's ``otherData``.

    Where a rank runs several stages (interleaved), its thread is the rank's, named with its stages; each action's
    slice is named with its stage (``2F3``) and carries it (``args.stage``), so a query or the slice's details pick one
    virtual stage out."""
    spans = list(spans)
    origin = min((s.start_s for s in spans), default=0.0)
    events: list[dict] = []
    for replica in sorted({s.replica for s in spans}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": replica, "args": {"name": f"{title}, replica {replica}"}}
        )
        for stage in sorted({s.stage for s in spans if s.replica == replica}):
            on_rank = [s for s in spans if s.replica == replica and s.stage == stage]
            virtual = sorted({v for v in map(_virtual_stage, (s.work for s in on_rank)) if v is not None})
            name = f"stages {', '.join(map(str, virtual))}" if virtual else f"stage {stage}"
            events.append({"name": "thread_name", "ph": "M", "pid": replica, "tid": stage, "args": {"name": name}})
    for span in spans:
        named = _virtual_stage(span.work)
        events.append(
            {
                "name": span.name,
                "cat": span.phase.value if span.phase is not None else span.name,
                "ph": "X",
                "pid": span.replica,
                "tid": span.stage,
                "ts": (span.start_s - origin) * 1e6,
                "dur": (span.end_s - span.start_s) * 1e6,
                "args": {"step": span.step, **({"stage": named} if named is not None else {})},
            }
        )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}})


def _virtual_stage(work: Action | str) -> int | None:
    """The stage an action names (on a rank that runs several); None for other work."""
    return work.stage if isinstance(work, Action) else None


def read_chrome_trace(text: str) -> tuple[list[Span], dict[str, Any]]:
    """The spans and the metadata of a trace written by `chrome_trace`."""
    trace = json.loads(text)
    spans = [
        Span(
            e["tid"],
            work_of(e["name"]),
            e["ts"] / 1e6,
            (e["ts"] + e["dur"]) / 1e6,
            e["pid"],
            e.get("args", {}).get("step", 0),
        )
        for e in trace["traceEvents"]
        if e["ph"] == "X"
    ]
    return spans, trace.get("otherData", {})
