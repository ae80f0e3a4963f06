"""Test-only hooks into the background checkpoint upload of a multi-process run (used by run_pipelined.py).

`WatchUploads` holds each save's upload in flight on rank 0, after its first file reached the store, until the
main thread has looked at the store; it also records what the store holds whenever a checkpoint is pruned.
`FailUpload` makes one rank's upload of one save fail; `SlowUploads` makes every upload take longer.
"""

from __future__ import annotations

import posixpath
import queue
import re
import time
from typing import Any

import lightning as L

from lightning_varuna.checkpoint.consolidate import consolidate
from lightning_varuna.checkpoint.layout import IncompleteCheckpointError, versions
from lightning_varuna.storage import Storage

HOLD_TIMEOUT = 120.0  # seconds: a hold that nobody releases fails the upload instead of hanging the job


def step_of(url: str) -> int:
    """The global step in a ModelCheckpoint file name (``.../epoch=0-step=3.ckpt/...``)."""
    return int(re.search(r"step=(\d+)\.ckpt", url).group(1))


def describe_store(storage: Storage, dirpath: str) -> dict[str, dict[str, Any]]:
    """Every checkpoint in ``dirpath``: its save versions and, if one is complete, the step it loads at."""
    found = {}
    for name in storage.children(dirpath):
        url = posixpath.join(dirpath, name)
        try:
            loaded_step = consolidate(url, storage)["global_step"]
        except IncompleteCheckpointError:
            loaded_step = None
        found[name] = {"versions": versions(storage, url), "loads_step": loaded_step}
    return found


class HeldStorage(Storage):
    """Storage whose uploads stop after the first file of every save until `released` gets an item."""

    def __init__(self, storage_options: dict[str, Any], dirpath: str, events: list[dict]) -> None:
        super().__init__(storage_options)
        self.dirpath, self.events = dirpath.rstrip("/"), events
        self.reached: queue.Queue[str] = queue.Queue()
        self.released: queue.Queue[bool] = queue.Queue()
        self._held: set[str] = set()

    def put_file(self, local_path: str, url: str) -> None:
        super().put_file(local_path, url)
        version_url = posixpath.dirname(url)
        if version_url in self._held:
            return
        self._held.add(version_url)
        self.reached.put(version_url)
        self.released.get(timeout=HOLD_TIMEOUT)

    def remove(self, url: str) -> None:
        if posixpath.dirname(url.rstrip("/")) == self.dirpath:  # a whole checkpoint (not a version, not a probe)
            self.events.append({"pruned": posixpath.basename(url), "store": describe_store(self, self.dirpath)})
        super().remove(url)


class WatchUploads(L.Callback):
    """On rank 0: before every step after a save and at the end, wait until that save's upload is held in flight,
    record what the store holds (``events``), then let the upload go on."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.events: list[dict] = []
        self.storage: HeldStorage | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            options = trainer.strategy.checkpoint_storage.storage_options
            self.storage = HeldStorage(options, self.dirpath, self.events)
            trainer.strategy._checkpoints.storage = self.storage

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > 0:  # a save happened after every step
            self._observe(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._observe(trainer)

    def _observe(self, trainer: L.Trainer) -> None:
        if self.storage is None:
            return
        held = self.storage.reached.get(timeout=HOLD_TIMEOUT)
        store = describe_store(self.storage, self.dirpath)
        self.events.append({"held": held, "step": trainer.global_step, "store": store})
        self.storage.released.put(True)


class FailingStorage(Storage):
    """Storage whose upload of the save at global step ``step`` fails."""

    def __init__(self, storage_options: dict[str, Any], step: int) -> None:
        super().__init__(storage_options)
        self.step = step

    def put_file(self, local_path: str, url: str) -> None:
        if step_of(url) == self.step:
            raise OSError(f"test: the upload of {url} fails")
        super().put_file(local_path, url)


class FailUpload(L.Callback):
    """Rank ``rank``'s upload of the save at global step ``step`` fails."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == self.rank:
            options = trainer.strategy.checkpoint_storage.storage_options
            trainer.strategy._checkpoints.storage = FailingStorage(options, self.step)


class SlowUploads(L.Callback):
    """Every file of a background upload reaches the store ``seconds`` later (a slow link to the store)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        storage = trainer.strategy.checkpoint_storage
        put_file = storage.put_file

        def slow_put_file(local_path: str, url: str) -> None:
            time.sleep(self.seconds)
            put_file(local_path, url)

        storage.put_file = slow_put_file
