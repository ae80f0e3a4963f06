"""What a sweep shows: one progress bar per model, a summary table at the end, the device timeline as a trace."""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TextIO

import lightning.pytorch as pl
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from lightning_varuna.multimodel.scheduler import DeviceSpan

_GPU_ROWS = 1000  # trace rows of the GPUs' own timing start here

__all__ = [
    "ModelResult",
    "StudyDisplay",
    "SweepDisplay",
    "device_timeline_trace",
    "summary_table",
    "warning_shown_by",
]


@dataclass
class ModelResult:
    """How one model of a sweep ended.

    Attributes:
        name: the model's name in the sweep.
        trainer: its Lightning Trainer.
        status: "finished", "failed" (``error`` says why) or "stopped" (SIGTERM, Ctrl-C: resume from its last
            checkpoint).
        error: the exception that ended its fit, if any.
        steps: optimizer steps taken in this sweep.
        final_loss: the loss of its last training step.
        seconds: wall time of its fit.
        device_s: device time of its shards.
    """

    name: str
    trainer: pl.Trainer
    status: str = "pending"
    error: BaseException | None = None
    steps: int = 0
    final_loss: float | None = None
    seconds: float = 0.0
    device_s: float = 0.0


class SweepDisplay:
    """One progress bar per model, in the order added, updated in place."""

    def __init__(self, names: Sequence[str]) -> None:
        width = max(len(name) for name in names)
        self._bars = {
            name: tqdm(desc=name.ljust(width), total=None, unit="step", position=i, leave=True, mininterval=0.5)
            for i, name in enumerate(names)
        }

    def started(self, name: str, total_steps: float, steps_before: int) -> None:
        bar = self._bars[name]
        bar.reset(total=None if total_steps == float("inf") else int(total_steps))
        bar.update(steps_before)

    def stepped(self, name: str, steps: int, loss: float | None) -> None:
        """``name``'s model has taken ``steps`` optimizer steps (its last batch's loss: ``loss``)."""
        bar = self._bars[name]
        if loss is not None:
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        bar.update(steps - bar.n)

    def ended(self, name: str, status: str) -> None:
        """``name``'s fit has ended: its bar says how, unless it simply finished."""
        bar = self._bars[name]
        if status != "finished":
            bar.set_postfix_str(status)
        bar.refresh()

    @contextmanager
    def logs_above(self) -> Iterator[None]:
        """Print log lines (Lightning's, which do not propagate, and those that reach the root logger: this package's)
        and Python's warnings above the bars, not into them."""
        loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", None)]
        show = warnings.showwarning
        warnings.showwarning = warning_shown_by(partial(tqdm.write, file=sys.stderr, end=""))
        try:
            with logging_redirect_tqdm(loggers=loggers, tqdm_class=tqdm):
                yield
        finally:
            warnings.showwarning = show

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()


class StudyDisplay(SweepDisplay):
    """A row per running trial of a study (its number and parameters, steps, loss, last reported ``monitor``, how it
    ended), under a line for the study; a row is used again by the next trial once its trial has ended."""

    def __init__(self, rows: int, study_name: str) -> None:
        self._study = tqdm(desc=f"study {study_name}", total=None, position=0, leave=True, bar_format="{desc}")
        self._free = [tqdm(total=None, unit="step", position=i + 1, leave=True, mininterval=0.5) for i in range(rows)]
        self._bars: dict[str, Any] = {}
        self._monitors: dict[str, tuple[str, Callable[[], float | None]]] = {}

    def watch(self, name: str, monitor: str, value: Callable[[], float | None]) -> None:
        """Show ``value()``, the trial's last reported ``monitor``, on ``name``'s row."""
        self._monitors[name] = monitor, value

    def started(self, name: str, total_steps: float, steps_before: int) -> None:
        if name not in self._bars:  # a free row, which says how its last trial ended until now
            self._bars[name] = self._free.pop(0)
            self._bars[name].set_postfix_str("", refresh=False)
            self._bars[name].set_description_str(name)
        super().started(name, total_steps, steps_before)

    def stepped(self, name: str, steps: int, loss: float | None) -> None:
        bar = self._bars.get(name)
        if bar is None:
            return
        postfix = {"loss": f"{loss:.4g}"} if loss is not None else {}
        if name in self._monitors:
            monitor, value = self._monitors[name]
            last = value()
            if last is not None:
                postfix[monitor] = f"{last:.4g}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(steps - bar.n)

    def ended(self, name: str, status: str) -> None:
        """``name``'s trial has ended in state ``status`` ("complete", "pruned", "failed", "handed over"): its row
        says so until the next trial takes it."""
        bar = self._bars.pop(name, None)
        if bar is not None:
            bar.set_postfix_str(status)
            bar.refresh()
            self._free.append(bar)

    def has_free_row(self) -> bool:
        """Whether a trial that has not started yet has a row to start on."""
        return bool(self._free)

    def summary(self, text: str) -> None:
        """The study's line: its trials so far and its best value."""
        self._study.set_description_str(text)

    def close(self) -> None:
        for bar in [self._study, *self._free, *self._bars.values()]:
            bar.close()


def warning_shown_by(write: Callable[[str], None]) -> Callable[..., None]:
    """A `warnings.showwarning` that gives ``write`` the warning's text as Python prints it."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        write(warnings.formatwarning(message, category, filename, lineno, line))

    return show


def summary_table(results: Iterable[ModelResult]) -> str:
    """A text table: model, status, steps, final loss, time, share of the devices' time."""
    results = list(results)
    total_device_s = sum(r.device_s for r in results) or 1.0
    rows = [("model", "status", "steps", "final loss", "time (s)", "device share")]
    rows += [
        (
            r.name,
            r.status,
            str(r.steps),
            "-" if r.final_loss is None else f"{r.final_loss:.4g}",
            f"{r.seconds:.1f}",
            f"{r.device_s / total_device_s:.0%}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def device_timeline_trace(
    spans: Iterable[DeviceSpan], metadata: dict[str, Any] | None = None, gpu_spans: Iterable[DeviceSpan] = ()
) -> str:
    """A Chrome / Perfetto trace (ui.perfetto.dev, chrome://tracing): one row per device, a slice per shard turn
    named after its model (so coloured by model), with its work and shard as arguments. On GPUs, ``spans`` are the
    host's time issuing each turn and ``gpu_spans`` the GPU's running it: a row each."""
    rows = [(list(spans), "device {}", 0), (list(gpu_spans), "GPU {} (running)", _GPU_ROWS)]
    origin = min((s.start_s for row, *_ in rows for s in row), default=0.0)
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "sweep"}}]
    for row, label, offset in rows:
        events += [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": offset + device, "args": {"name": label.format(device)}}
            for device in sorted({s.device for s in row})
        ]
        events += [
            {
                "name": s.model,
                "cat": s.work,
                "ph": "X",
                "pid": 0,
                "tid": offset + s.device,
                "ts": (s.start_s - origin) * 1e6,
                "dur": (s.end_s - s.start_s) * 1e6,
                "args": {"work": s.work, "shard": s.shard},
            }
            for s in row
        ]
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}})
