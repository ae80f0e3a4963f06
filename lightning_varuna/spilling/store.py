"""Where the tensors of a shard wait while other shards are on the device: host memory, or one file per part in a
folder (the disk tier), read back on a background thread ahead of use."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_varuna._torch_private import storage_users

__all__ = ["SpillStore"]

_ALIGNMENT = 64  # bytes: every tensor of a file starts at a multiple of this, so it can be viewed as any dtype


@dataclass(frozen=True)
class _Slot:
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int


class SpillStore:
    """Parts (a shard's parameters, gradients or optimizer state: lists of tensors) spilled under a key.

    With ``folder=None`` a part stays in host memory: on a CUDA device as a pinned copy, on the CPU as the tensors
    themselves (host memory is the device's). With a folder, a part is one file, written through and dropped from
    the page cache, so it takes no memory while spilled. A part stored again overwrites its file in place, so the
    file system allocates no blocks (writes twice as fast as to a new file, and no more room needed). Files are
    written and read on one background thread, in the order asked: `put` returns at once (the tensors are freed
    once written), `prefetch` starts a read, `get` waits for it. One thread keeps at most one part in flight, so a
    write finishes before the next read starts.

    On a CUDA device a part in host memory is a pinned copy, written again in place each time the part is stored.
    The copies to the device run on a stream of their own, so that a prefetch overlaps the computation on the
    current stream; `get` makes the current stream wait for them. The host issues a GPU's work ahead of it, and the
    device memory of a part stored is only free again once the GPU has done what was issued before: so a part is
    brought to the device only once the GPU has stored the last part `put` (the host waits), which keeps what is on
    the device to the parts in use.
    """

    def __init__(self, device: torch.device, folder: str | os.PathLike | None = None) -> None:
        self.device = device
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None and device.type == "cpu":
            _give_freed_memory_back()
        self._host: dict[str, list[Tensor]] = {}
        self._copies = torch.cuda.Stream(device) if device.type == "cuda" else None  # host -> device copies
        self._last_stored: torch.cuda.Event | None = None  # when the last host copy of device tensors is complete
        self._arriving: dict[str, tuple[list[Tensor], torch.cuda.Event]] = {}  # host-tier prefetches on their way
        self._layouts: dict[str, list[_Slot]] = {}
        self._pending: dict[str, Future[list[Tensor]]] = {}
        self._writes: dict[str, Future[None]] = {}
        self._io = ThreadPoolExecutor(1, thread_name_prefix="spill-io")
        self._buffers = ReadBuffers(pinned=device.type == "cuda")
        self.bytes_written = 0
        self.bytes_read = 0

    def __contains__(self, key: str) -> bool:
        return key in self._host or key in self._layouts

    def put(self, key: str, tensors: list[Tensor]) -> None:
        """Spill ``tensors`` under ``key``, replacing what was there."""
        if self.folder is None and self._copies is not None:
            self._put_pinned(key, tensors)
            return
        self._forget(key)
        if self.folder is None:
            self._host[key] = [t.detach() for t in tensors]
            return
        slots = self._layouts[key] = _layout(tensors)
        self._writes[key] = self._io.submit(self._write, self.folder / f"{key}.bin", tensors, slots)

    def _put_pinned(self, key: str, tensors: list[Tensor]) -> None:
        """Copy device ``tensors`` to the pinned host copy of ``key`` (the one it has, if they fit it), on the current
        stream, once the copies from it to the device are done."""
        current = torch.cuda.current_stream(self.device)
        arriving = self._arriving.pop(key, None)
        if arriving is not None:
            current.wait_event(arriving[1])
        host = self._host.get(key)
        if host is None or [(h.shape, h.dtype) for h in host] != [(t.shape, t.dtype) for t in tensors]:
            host = self._host[key] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for copy, tensor in zip(host, tensors):
            copy.copy_(tensor.detach(), non_blocking=True)
        self._last_stored = torch.cuda.Event()
        self._last_stored.record(current)

    def _wait_last_stored(self) -> None:
        """Wait until the GPU has stored the last part `put` (and so freed the device memory of every part before)."""
        if self._last_stored is not None:
            self._last_stored.synchronize()

    def prefetch(self, key: str) -> None:
        """Start bringing ``key`` back to the device (no-op if it is on its way or not spilled)."""
        if key in self._layouts and key not in self._pending:
            self._pending[key] = self._io.submit(self._read, key)
        elif key in self._host and self._copies is not None and key not in self._arriving:
            self._arriving[key] = self._copy_in(key)

    def get(self, key: str) -> list[Tensor]:
        """The tensors spilled under ``key``, on the device (still spilled: `put` again after changing them)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            return self._arrived(pending.result())
        if key in self._host:
            if self._copies is None:
                return list(self._host[key])
            arriving = self._arriving.pop(key, None)
            tensors, done = arriving if arriving is not None else self._copy_in(key)
            torch.cuda.current_stream(self.device).wait_event(done)
            return self._arrived(tensors)
        return self._arrived(self._io.submit(self._read, key).result())

    def _copy_in(self, key: str) -> tuple[list[Tensor], torch.cuda.Event]:
        """Copy the pinned host tensors of ``key`` to the device on the copy stream, once the last part stored is
        (see the class); the event marks the end."""
        assert self._copies is not None
        self._wait_last_stored()
        with torch.cuda.stream(self._copies):
            tensors = [t.to(self.device, non_blocking=True) for t in self._host[key]]
            done = torch.cuda.Event()
            done.record(self._copies)
        return tensors, done

    def _arrived(self, tensors: list[Tensor]) -> list[Tensor]:
        """Tensors made on the copy stream, handed to the current stream (the allocator frees them in its order)."""
        if self._copies is not None:
            current = torch.cuda.current_stream(self.device)
            for t in tensors:
                t.record_stream(current)
        return tensors

    def in_host_memory(self, key: str) -> list[Tensor]:
        """The tensors spilled under ``key``, in host memory, without copying them: the host tier's own (or its pinned
        copies), or the disk tier's file mapped into memory (shared: its pages are read where touched, count as the
        file's rather than as the process's own memory, and stay valid after the file is removed)."""
        if self.folder is None:
            if self._last_stored is not None:
                self._last_stored.synchronize()  # the pinned copies are complete
            return list(self._host[key])
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.result()  # a read under way: let it end
        self.wait_written(key)
        slots = self._layouts[key]
        size = max((s.offset + s.nbytes for s in slots), default=0)
        if size == 0:
            return [torch.empty(s.shape, dtype=s.dtype) for s in slots]
        data = torch.from_file(str(self.folder / f"{key}.bin"), shared=True, size=size, dtype=torch.uint8)
        return [data[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in slots]

    def wait_written(self, key: str) -> None:
        """Wait until what `put` stored under ``key`` is written (and its tensors freed); raise if the write failed."""
        write = self._writes.get(key)
        if write is not None:
            write.result()

    def discard(self, key: str) -> None:
        """Drop what is spilled under ``key`` (and its file)."""
        if self._forget(key):
            assert self.folder is not None
            (self.folder / f"{key}.bin").unlink(missing_ok=True)

    def _forget(self, key: str) -> bool:
        """Let the reads and writes of ``key`` finish and drop it, but not its file; return whether it had one."""
        for pending in (self._pending.pop(key, None), self._writes.pop(key, None)):
            if pending is not None:
                pending.result()
        self._host.pop(key, None)
        self._arriving.pop(key, None)
        return self._layouts.pop(key, None) is not None

    def close(self) -> None:
        for key in list(self._host) + list(self._layouts):
            self.discard(key)
        self._io.shutdown(wait=True)

    def _write(self, path: Path, tensors: list[Tensor], slots: list[_Slot]) -> None:
        size = max((s.offset + s.nbytes for s in slots), default=0)
        try:
            # Opened without truncating: a file rewritten at its size keeps its blocks.
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                for t, slot in zip(tensors, slots):
                    f.seek(slot.offset)
                    f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
                if os.fstat(f.fileno()).st_size > size:
                    f.truncate(size)
                f.flush()
                os.fdatasync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # written through: drop the page cache
        except BaseException as error:
            path.unlink(missing_ok=True)  # partly rewritten: nothing may read it
            if not isinstance(error, OSError):
                raise
            raise OSError(
                error.errno,
                f"Cannot spill {size} bytes to `{path}` ({error.strerror}). Give SpillingStrategy a `spill_dir` "
                "with room for the model's parameters, gradients and optimizer state, or `spill_dir=None` to keep "
                "them in host memory",
            ) from error
        self.bytes_written += size

    def _read(self, key: str) -> list[Tensor]:
        assert self.folder is not None
        written = self._writes.get(key)
        if written is not None:
            written.result()  # done (one thread, in order); raises if the write failed
        slots = self._layouts[key]
        size = max((s.offset + s.nbytes for s in slots), default=0)
        buffer = self._buffers.take(size)
        with open(self.folder / f"{key}.bin", "rb", buffering=0) as f:
            view, done = buffer.numpy().data, 0
            while done < size:
                read = f.readinto(view[done:])
                if not read:
                    raise OSError(f"`{self.folder / f'{key}.bin'}` ended after {done} of {size} bytes")
                done += read
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self.bytes_read += size
        if self._copies is not None:
            with torch.cuda.stream(self._copies):
                buffer = buffer.to(self.device, non_blocking=True)
            self._copies.synchronize()  # this thread waits, not the computation
        return [buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in slots]


class ReadBuffers:
    """The buffers the disk tier reads into, each used again once nothing else holds it (the tensors of the part read
    into it were dropped or stored again): a new buffer costs a page fault per page on the first read into it (reads
    about 25% slower here) or, pinned, a slow allocation. Unused buffers are kept while all the buffers together take
    no more memory than was ever in use at once (which the memory budget bounds), the oldest freed first."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: list[Tensor] = []
        self._most_in_use = 0  # bytes

    def take(self, size: int) -> Tensor:
        """An unused buffer of ``size`` bytes."""
        unused = [b for b in self._buffers if storage_users(b) == 1]
        buffer = next((b for b in unused if b.numel() == size), None)
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            self._buffers.append(buffer)
        spares = [b for b in unused if b is not buffer]
        held = sum(b.numel() for b in self._buffers)
        self._most_in_use = max(self._most_in_use, held - sum(b.numel() for b in spares))
        freed: set[int] = set()
        for spare in spares:
            if held <= self._most_in_use:
                break
            freed.add(id(spare))
            held -= spare.numel()
        self._buffers = [b for b in self._buffers if id(b) not in freed]
        return buffer


def _layout(tensors: list[Tensor]) -> list[_Slot]:
    """Where each tensor goes in a part's file: one after another, each aligned."""
    slots, offset = [], 0
    for t in tensors:
        offset = -(-offset // _ALIGNMENT) * _ALIGNMENT
        nbytes = t.numel() * t.element_size()
        slots.append(_Slot(t.shape, t.dtype, offset, nbytes))
        offset += nbytes
    return slots


def _give_freed_memory_back() -> None:
    """Make glibc return freed blocks of 64 KiB or more to the OS at once (a fixed ``M_MMAP_THRESHOLD``).

    By default glibc raises that threshold to the largest block freed so far, so after the first shard is freed
    the next shards' buffers come from its heap, which keeps freed memory: host memory would grow by shards'
    sizes instead of staying within the budget.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD = -3
