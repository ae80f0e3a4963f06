"""A Python that has imported the libraries once and forks each test job from itself.

    python tests/preloaded_jobs.py      # one job request per line on stdin, JSON; replies on stdout

A request is ``{"ranks": bool, "args": [...], "cwd": ..., "env": {...}, "stdout": PATH, "stderr": PATH}``: with
``ranks``, ``args`` are `forked_ranks`' (PROCESSES DEVICES_PER_NODE SCRIPT ...) and the job is its ranks; without,
they are ``SCRIPT ARGS`` and the job is that script, run as ``python SCRIPT ARGS`` runs it (under Lightning's
launcher, its other processes are fresh Pythons it starts). The server forks; the fork starts a session of its own
(its process group is the job's, as for `conftest.run_job`), takes the job's folder, environment and output files,
and runs it. The server replies with the job's pid at once and with its exit status (as ``subprocess`` gives it:
negative for a signal) when it ends, then takes the next request.

What this saves over a fresh Python per job is the import of torch and Lightning in the job's first process
(about 4 s of CPU). What libraries read from the environment while they are imported is the server's environment
(the test session's), not the job's: a job with an environment of its own starts fresh.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import traceback

import forked_ranks


def serve() -> None:
    """Run the requests on stdin one after the other until stdin closes."""
    gc.freeze()  # the imported libraries' objects: never collected, so never copied into a job by the collector
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run(job)
        _reply(pid)
        _, wait_status = os.waitpid(pid, 0)
        _reply(os.waitstatus_to_exitcode(wait_status))


def _run(job: dict) -> None:
    """In the fork: run ``job`` as a fresh `forked_ranks` process would, then exit with its status."""
    status = 1
    try:
        os.setsid()
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        _redirect(0, os.devnull, os.O_RDONLY)
        _redirect(1, job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        _redirect(2, job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        if job["ranks"]:
            processes, devices, script, *args = job["args"]
            status = forked_ranks.main(int(processes), int(devices), script, args)
        else:
            status = forked_ranks.run_script(job["args"][0], job["args"][1:])
            threading._shutdown()  # as a Python that ends: wait for the threads the script left running,
            atexit._run_exitfuncs()  # then run what it registered to run at exit
    except BaseException:  # noqa: BLE001 - the job's failure is its exit status, as for a fresh process
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def _reply(value: int) -> None:
    print(value, flush=True)


if __name__ == "__main__":
    serve()
