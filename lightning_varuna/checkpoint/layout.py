"""What a checkpoint looks like on storage, and how to tell a complete one from an interrupted one.

A checkpoint is a folder at the URL the user names (``.../epoch=0-step=20.ckpt``, ``.../last.ckpt``). Every
save into it writes a new *version* folder, so that overwriting ``last.ckpt`` never damages the previous
save until the new one is complete::

    last.ckpt/
      v01763674000123456789/     one save (the name is the time of the save, in ns)
        .metadata                torch.distributed.checkpoint's index of the tensors, by parameter name
        __0_0.distcp ...         the tensors each rank wrote (its stage's parameters and optimizer state)
        lightning_state.pt       Lightning's training state: loops, LR schedulers, callbacks, precision
        COMMITTED.json           written last, once every other file is in place: marks the save complete

A version without ``COMMITTED.json`` is an interrupted save and is never loaded; older versions are deleted
once a newer one is committed. A single-file checkpoint at the URL (Lightning's ``last.ckpt`` of a run without these
strategies) is renamed ``<name>.replaced`` by the first save there, and deleted once that save is committed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from lightning_varuna.storage import Storage, join

__all__ = [
    "COMMIT_MARKER",
    "DCP_INDEX",
    "LIGHTNING_STATE",
    "SET_ASIDE",
    "CheckpointInfo",
    "IncompleteCheckpointError",
    "find_newest",
    "new_version",
    "newest_commit",
    "open_complete",
    "run_shape",
    "versions",
]

COMMIT_MARKER = "COMMITTED.json"
DCP_INDEX = ".metadata"
LIGHTNING_STATE = "lightning_state.pt"
SET_ASIDE = ".replaced"
_VERSION_PREFIX = "v"


class IncompleteCheckpointError(FileNotFoundError):
    """A checkpoint that does not exist, was interrupted while being written, or lost files afterwards."""


@dataclass(frozen=True)
class CheckpointInfo:
    """The committed save of a checkpoint: where it is and what its commit marker says."""

    url: str
    version: str
    global_step: int
    epoch: int
    saved_at: float
    shape: dict[str, Any]

    @property
    def version_url(self) -> str:
        return join(self.url, self.version)

    def marker(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if k not in ("url", "version")}, indent=1).encode()

    @classmethod
    def from_marker(cls, url: str, version: str, data: bytes) -> CheckpointInfo:
        return cls(url=url, version=version, **json.loads(data))


def run_shape(
    pipeline_parallel_size: int,
    data_parallel_size: int,
    micro_batch_size: int | None,
    global_batch_size: int | None,
    data_position: dict[str, int],
) -> dict[str, Any]:
    """What a save records of the run that wrote it (`CheckpointInfo.shape`), whichever strategy wrote it."""
    return {
        "pipeline_parallel_size": pipeline_parallel_size,
        "data_parallel_size": data_parallel_size,
        "micro_batch_size": micro_batch_size,
        "global_batch_size": global_batch_size,
        "data_position": data_position,
    }


def new_version() -> str:
    """A version name that sorts after every earlier save."""
    return f"{_VERSION_PREFIX}{time.time_ns():020d}"


def versions(storage: Storage, url: str) -> list[str]:
    """The save versions under checkpoint ``url``, oldest first (committed or not)."""
    return [name for name in storage.children(url) if name.startswith(_VERSION_PREFIX) and name[1:].isdigit()]


def newest_commit(storage: Storage, url: str) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest committed save under ``url``, and the versions newer than it that were never committed."""
    uncommitted: list[str] = []
    for version in reversed(versions(storage, url)):
        marker = join(url, version, COMMIT_MARKER)
        if storage.exists(marker):
            return CheckpointInfo.from_marker(url, version, storage.read_bytes(marker)), uncommitted
        uncommitted.append(version)
    return None, uncommitted


def open_complete(storage: Storage, url: str) -> CheckpointInfo:
    """The committed save under ``url`` after checking that every file it lists is there; else a clear error."""
    info, uncommitted = newest_commit(storage, url)
    if info is None:
        if not storage.exists(url):
            raise IncompleteCheckpointError(f"No checkpoint at {url!r}: the path does not exist.")
        why = (
            f"its save(s) {uncommitted} have no {COMMIT_MARKER} (the job stopped while writing them)"
            if uncommitted
            else "it holds no VarunaStrategy checkpoint versions"
        )
        raise IncompleteCheckpointError(f"{url!r} is not a complete checkpoint: {why}. Pick an earlier checkpoint.")
    present = storage.sizes(info.version_url)
    needed = {DCP_INDEX: 1, LIGHTNING_STATE: 1}  # name: the bytes it must hold at least
    if DCP_INDEX in present:
        metadata = storage.dcp_reader(info.version_url).read_metadata()
        for item in metadata.storage_data.values():
            needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    held = {name: needed.get(name, 0) if size is None else size for name, size in present.items()}  # None: unknown
    damaged = [
        f"{name} is missing" if name not in held else f"{name} holds {held[name]} of its {size} bytes"
        for name, size in sorted(needed.items())
        if held.get(name, -1) < size
    ]
    if damaged:
        raise IncompleteCheckpointError(
            f"Checkpoint {info.version_url!r} is committed but {', '.join(damaged)}: it was damaged after it was "
            "written. Pick an earlier checkpoint."
        )
    return info


def find_newest(storage: Storage, dirpaths: list[str]) -> tuple[CheckpointInfo | None, list[str]]:
    """The most recently committed checkpoint in any of ``dirpaths``, and the interrupted saves skipped."""
    newest: CheckpointInfo | None = None
    incomplete: list[str] = []
    for dirpath in dirpaths:
        for name in storage.children(dirpath):
            url = join(dirpath, name)
            info, uncommitted = newest_commit(storage, url)
            incomplete.extend(join(url, version) for version in uncommitted)
            if info is not None and (newest is None or info.saved_at > newest.saved_at):
                newest = info
    return newest, incomplete
