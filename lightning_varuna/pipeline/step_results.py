"""Send what a step produced on the last stage (the values it logged, its output) to the other stages of its
replica, without the last stage waiting for them."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.pipeline.waiting import Waiter

__all__ = ["StepResults"]


class StepResults:
    """The last stage posts each step's results (pickled, two messages per other stage) and goes on; the others
    receive them when their own part of the step is done, which is later anyway (their last backward comes after
    the last stage's). One `exchange` per step on every stage, in the same order.

    Args:
        topology: this rank's place in the job.
        group: a process group over this replica's stages used for nothing else.
        waiter: waits for a message, giving up when ``on_wait`` raises (a peer failed, SIGTERM).
    """

    def __init__(self, topology: Topology, group: dist.ProcessGroup | None, waiter: Waiter) -> None:
        self._ranks = topology.stage_ranks()
        self._source = self._ranks[topology.last_stage_position]
        self._is_last = topology.is_last_stage
        self._group, self._waiter = group, waiter
        self._sending: list[Any] = []

    def exchange(self, results: Any, on_wait: Callable[[], None]) -> Any:
        """On the last stage: send ``results`` and return them; elsewhere: return the last stage's."""
        if len(self._ranks) == 1:
            return results
        if self._is_last:
            self.flush(on_wait)
            data = torch.frombuffer(bytearray(_pickled(results)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            for rank in (r for r in self._ranks if r != self._source):
                self._sending += [dist.isend(size, rank, self._group), dist.isend(data, rank, self._group)]
            return results
        return pickle.loads(self._waiter.call(self._receive, on_wait))

    def _receive(self) -> bytes:
        source = self._source
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, source, self._group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, source, self._group)
        return data.numpy().tobytes()

    def flush(self, on_wait: Callable[[], None]) -> None:
        """Wait until the results sent so far have left (before the next send, and at the end of a run)."""
        sending, self._sending = self._sending, []
        if sending:
            self._waiter.call(lambda: [work.wait() for work in sending], on_wait)


def _pickled(results: Any) -> bytes:
    try:
        return pickle.dumps(results)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as error:  # what pickling a value raises
        raise TypeError(
            "A pipelined step's results (what the step returns, beside a training step's loss, and what it logs) are "
            f"sent from the last stage to the other stages, and these cannot be pickled ({type(error).__name__}: "
            f"{error}). Return and log tensors, numbers, strings, and lists or dicts of them."
        ) from error
