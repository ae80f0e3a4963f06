"""One place for fsspec access to checkpoint URLs (and torch's fsspec reader/writer for DCP)."""

from __future__ import annotations

import posixpath
import threading
import uuid
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemWriter

from lightning_varuna._torch_private import FsspecReader, FsspecWriter
from lightning_varuna.storage.range_reader import RangeReader

__all__ = ["Storage", "join"]

# Files (and threads) per rank when DCP writes straight to a remote store: each file is one stream that waits for
# its upload requests, so several overlap the network with serializing the next tensors.
REMOTE_WRITE_THREADS = 4


def join(url: str, *names: str) -> str:
    """``url/name/...`` for a local path or any fsspec URL."""
    return posixpath.join(str(url).rstrip("/"), *names)


class Storage:
    """Files under fsspec URLs, opened with the same ``storage_options`` (credentials, endpoint) every time.

    Args:
        storage_options: keyword arguments for the fsspec filesystem (e.g. ``{"endpoint_url": ...}`` for s3fs).
            fsspec's own configuration applies too (``FSSPEC_S3_ENDPOINT_URL``-style environment variables).
        timeout: seconds that the first access to a store may take before it is reported unreachable.
    """

    def __init__(self, storage_options: dict[str, Any] | None = None, timeout: float = 60.0) -> None:
        self.storage_options = dict(storage_options or {})
        self.timeout = timeout
        self._checked: set[str] = set()

    def with_options(self, storage_options: dict[str, Any] | None) -> Storage:
        """This storage with ``storage_options`` added (for one call that passes its own)."""
        if not storage_options:
            return self
        return Storage({**self.storage_options, **storage_options}, self.timeout)

    @property
    def fs_options(self) -> dict[str, Any]:
        """``storage_options`` with listings never cached: other ranks and jobs add and delete checkpoint versions
        between two reads (a stale listing named a version that rank 0 had deleted)."""
        return {**self.storage_options, "use_listings_cache": False}

    def fs(self, url: str) -> tuple[AbstractFileSystem, str]:
        """The filesystem of ``url`` and the path on it."""
        return url_to_fs(str(url), **self.fs_options)

    def is_local(self, url: str) -> bool:
        """Whether ``url`` is on this machine's filesystem (a path or ``file://``)."""
        return isinstance(self.fs(url)[0], LocalFileSystem)

    def exists(self, url: str) -> bool:
        fs, path = self.fs(url)
        return fs.exists(path)

    def children(self, url: str) -> list[str]:
        """Names of the entries directly under ``url`` (empty if it does not exist)."""
        fs, path = self.fs(url)
        if not fs.isdir(path):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))

    def sizes(self, url: str) -> dict[str, int | None]:
        """The files directly under ``url`` (links to files too): name to size in bytes, None where the store does
        not say (empty if ``url`` does not exist)."""
        fs, path = self.fs(url)
        if not fs.isdir(path):
            return {}
        entries = fs.ls(path, detail=True)
        return {
            posixpath.basename(e["name"].rstrip("/")): None if e.get("size") is None else int(e["size"])
            for e in entries
            if e.get("type") != "directory"
        }

    def read_bytes(self, url: str) -> bytes:
        fs, path = self.fs(url)
        return fs.cat_file(path)

    def write_bytes(self, url: str, data: bytes) -> None:
        fs, path = self.fs(url)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)

    def put_file(self, local_path: str, url: str) -> None:
        fs, path = self.fs(url)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.put_file(local_path, path)

    def remove(self, url: str) -> None:
        """Delete ``url`` and everything under it, if it exists."""
        fs, path = self.fs(url)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def dcp_writer(self, url: str) -> FileSystemWriter:
        """A torch.distributed.checkpoint writer for ``url`` (no fsync: object stores have none); one file per
        rank on a local filesystem, `REMOTE_WRITE_THREADS` written concurrently elsewhere."""
        threads = 1 if self.is_local(url) else REMOTE_WRITE_THREADS
        return FsspecWriter(str(url), sync_files=False, thread_count=threads, **self.fs_options)

    def dcp_reader(self, url: str) -> FsspecReader:
        """A torch.distributed.checkpoint reader for ``url``: DCP's own on a local filesystem (it reads the page
        cache in place, faster than copying windows out of it), `RangeReader` elsewhere."""
        reader = FsspecReader if self.is_local(url) else RangeReader
        return reader(str(url), **self.fs_options)

    def check_writable(self, url: str) -> None:
        """Write and delete a probe file under ``url``; raise a clear error if that fails or hangs.

        Checked once per URL, so that a wrong endpoint or missing credentials show up at the first save
        (or at setup) instead of as a hang or a half-written checkpoint.
        """
        if url in self._checked:
            return
        errors: list[BaseException] = []

        def probe() -> None:
            try:
                probe_url = join(url, f".write-probe-{uuid.uuid4().hex}")
                self.write_bytes(probe_url, b"")
                self.remove(probe_url)
            except BaseException as err:  # noqa: BLE001 - reported below with the URL
                errors.append(err)

        thread = threading.Thread(target=probe, name="lightning-varuna-storage-probe", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise TimeoutError(
                f"Checkpoint storage {url!r} did not answer within {self.timeout:.0f} s. Check the URL, the "
                "endpoint and the network, or pass the right `storage_options`."
            )
        if errors:
            raise OSError(
                f"Cannot write checkpoints to {url!r}: {type(errors[0]).__name__}: {errors[0]}. Check the URL, the "
                "credentials and `storage_options` (or fsspec's FSSPEC_<PROTOCOL>_<OPTION> environment variables)."
            ) from errors[0]
        self._checked.add(url)
