"""Free TCP ports on loopback for the servers and process groups the tests start."""

from __future__ import annotations

import os
import random
import socket

# Below the kernel's ephemeral range (32768-60999 by default), from which the OS hands out the ports of outgoing
# connections: the gloo connections of a job running beside this one cannot take a port between its choice and the
# bind of the server it is for. Each pytest-xdist worker chooses from a range of its own.
_FIRST, _PER_WORKER = 20000, 500
_given: set[int] = set()  # not handed out twice: two servers may take theirs after both are chosen


def free_port() -> int:
    """A port nobody listens on now, from this test process's own range, not one it handed out before."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = _FIRST + _PER_WORKER * (int(worker) if worker.isdigit() else 0)
    for port in random.sample(range(first, first + _PER_WORKER), _PER_WORKER):
        if port in _given:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {first}-{first + _PER_WORKER - 1}")
