"""Start a job's ranks by forking one process that has imported the libraries, instead of one fresh Python each.

    python tests/forked_ranks.py PROCESSES DEVICES_PER_NODE SCRIPT [ARGS...]

Each rank runs ``SCRIPT ARGS`` as ``__main__`` with the launch variables ``LOCAL_RANK``, ``NODE_RANK``, ``RANK``,
``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``: Lightning takes the processes as started by another launcher
(its ``LightningEnvironment``; the script's ``Trainer(devices=..., num_nodes=...)`` must match) and runs them as
it runs any job's: real processes, a real gloo process group. What this saves is the import of torch, Lightning
and their optional dependencies (about 7 s of CPU) in every rank, which is most of a small test job's time, and of
what torch imports at its first trace (`torch.export`, about 0.4 s of a small rank's 1.2 s). The first rank to fail
ends the others (after 5 s to end on their own), as torchrun does; the exit status is the first failure's.
"""

from __future__ import annotations

import gc
import os
import runpy
import signal
import sys
import threading
import time

import lightning.pytorch  # noqa: F401 - imported once, before the fork, for every rank
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from ports import free_port

import lightning_varuna  # noqa: F401

torch.export.export(torch.nn.Linear(1, 1), (torch.zeros(1, 1),))  # imports what a stage's first trace imports

_GRACE_S = 5.0  # how long the other ranks have to end on their own after one failed


def run_rank(rank: int, processes: int, devices: int, script: str, args: list[str]) -> int:
    """Run ``script`` as rank ``rank`` of the job; its exit status."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank % devices), NODE_RANK=str(rank // devices), WORLD_SIZE=str(processes)
    )
    rank_zero_only.rank = rank  # what a fresh process reads from the launch variables as it imports Lightning
    return run_script(script, args)


def run_script(script: str, args: list[str]) -> int:
    """Run ``script`` with ``args`` as `python SCRIPT ARGS` runs it, in this process; its exit status."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` has it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or exit_.code == 0:
            return 0
        return exit_.code if isinstance(exit_.code, int) and 0 < exit_.code < 256 else 1
    except BaseException:  # noqa: BLE001 - the script's failure is its exit status, as for a fresh process
        sys.excepthook(*sys.exc_info())  # as Python reports it (torch.distributed's hook names the rank)
        return 1
    return 0


def main(processes: int, devices: int, script: str, args: list[str]) -> int:
    if threading.active_count() > 1:  # a fork copies only the calling thread: the others would be missing in a rank
        raise RuntimeError(f"the imports started threads, which the forked ranks would lack: {threading.enumerate()}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    gc.freeze()  # the imported libraries' objects: never collected, so never copied into a rank by the collector
    ranks = []
    for rank in range(processes):
        pid = os.fork()
        if pid == 0:
            status = run_rank(rank, processes, devices, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        ranks.append(pid)
    first_failure, kill_at = 0, None
    while ranks:
        pid, wait_status = os.waitpid(-1, os.WNOHANG if kill_at else 0)
        if pid == 0:  # after a failure: the others have until `kill_at` to end on their own
            if time.monotonic() < kill_at:
                time.sleep(0.05)
                continue
            for other in ranks:
                os.kill(other, signal.SIGKILL)
            kill_at = None  # wait for what was killed
            continue
        ranks.remove(pid)
        status = os.waitstatus_to_exitcode(wait_status)
        if status != 0 and first_failure == 0:
            first_failure = status if status > 0 else 128 - status
            # A failure usually fails the others too, each reporting its own error (a peer's failure it learned
            # of, or its own): they get a moment to, as torchrun's agent gives its workers, then are killed.
            kill_at = time.monotonic() + _GRACE_S
    return first_failure


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
