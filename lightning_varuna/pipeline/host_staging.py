"""Messages between stages on GPUs over gloo (ranks sharing one GPU, where NCCL refuses two ranks on one device):
gloo's point-to-point sends read and write host memory only, so a device tensor is sent from a pinned host copy and
received into a pinned host buffer, copied onto the device when the receive is waited for."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["StagedReceive", "host_copy", "host_buffer_like", "stages_through_host"]


def stages_through_host(device: torch.device, backend: str) -> bool:
    """Whether the messages of a stage on ``device`` over ``backend`` must go through host memory."""
    return device.type != "cpu" and backend == dist.Backend.GLOO


def host_copy(tensor: Tensor) -> Tensor:
    """A pinned host copy of the device tensor ``tensor``, complete when this returns (a send may read it at once)."""
    return host_buffer_like(tensor).copy_(tensor)


def host_buffer_like(buffer: Tensor) -> Tensor:
    """A pinned host buffer to receive what goes into the device tensor ``buffer``."""
    return torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)


class StagedReceive:
    """A receive into a host buffer (its ``work``) that puts what arrived into the device tensor ``buffer`` when
    waited for."""

    def __init__(self, work: dist.Work, host: Tensor, buffer: Tensor) -> None:
        self._work, self._host, self._buffer = work, host, buffer

    def wait(self) -> bool:
        self._work.wait()
        self._buffer.copy_(self._host)
        return True
