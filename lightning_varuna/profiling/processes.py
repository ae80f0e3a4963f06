"""Wait for the processes of a multi-process job, stopping all of them when one fails; start one again when
another process took its port."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["retried_on_port_clash", "wait_all"]

T = TypeVar("T")


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float, what: str) -> None:
    """Wait for every process; if one fails or ``timeout_s`` passes, kill the others and raise with the end of
    each failed process's log (``logs[i]`` is process ``i``'s)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.1)
    failed = [
        f"--- process {i} (exit code {p.returncode}) ---\n{log.read_text(errors='replace')[-3000:]}"
        for i, (p, log) in enumerate(zip(procs, logs))
        if p.returncode != 0
    ]
    if failed:
        raise RuntimeError(f"{what} failed or took over {timeout_s:.0f} s:\n" + "\n".join(failed))


def retried_on_port_clash(run: Callable[[], T], attempts: int = 3) -> T:
    """``run()``, again (``attempts`` in all) when it fails with ``EADDRINUSE``: a free port is found, then bound by
    the job's first process, and another process on a busy machine may take it in between. ``run`` must look for a
    free port of its own each time."""
    for attempt in range(attempts):
        try:
            return run()
        except Exception as error:
            if "EADDRINUSE" not in str(error) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
