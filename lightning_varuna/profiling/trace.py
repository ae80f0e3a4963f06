"""Write pipeline timelines (predicted or measured) as Chrome / Perfetto trace files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Span", "chrome_trace", "read_chrome_trace"]


@dataclass(frozen=True)
class Span:
    """One piece of work on one stage of one replica during a training step (seconds)."""

    stage: int
    name: str  # "F3", "R3", "B3", "all-reduce", "optimizer"
    start_s: float
    end_s: float
    replica: int = 0
    step: int = 0  # the training step, when a trace holds several


def chrome_trace(spans: Iterable[Span], title: str, metadata: dict[str, Any] | None = None) -> str:
    """A trace with one process per replica and one thread per stage; open it in ui.perfetto.dev or
    chrome://tracing. Times start at the earliest span; ``metadata`` goes into the trace's ``otherData``."""
    spans = list(spans)
    origin = min((s.start_s for s in spans), default=0.0)
    events: list[dict] = []
    for replica in sorted({s.replica for s in spans}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": replica, "args": {"name": f"{title}, replica {replica}"}}
        )
        for stage in sorted({s.stage for s in spans if s.replica == replica}):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": replica, "tid": stage, "args": {"name": f"stage {stage}"}}
            )
    for span in spans:
        events.append(
            {
                "name": span.name,
                "cat": span.name.rstrip("0123456789") or span.name,
                "ph": "X",
                "pid": span.replica,
                "tid": span.stage,
                "ts": (span.start_s - origin) * 1e6,
                "dur": (span.end_s - span.start_s) * 1e6,
                "args": {"step": span.step},
            }
        )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}})


def read_chrome_trace(text: str) -> tuple[list[Span], dict[str, Any]]:
    """The spans and the metadata of a trace written by `chrome_trace`."""
    trace = json.loads(text)
    spans = [
        Span(e["tid"], e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["pid"], e.get("args", {}).get("step", 0))
        for e in trace["traceEvents"]
        if e["ph"] == "X"
    ]
    return spans, trace.get("otherData", {})
