"""Save and load checkpoints in which every rank writes and reads only its own stage.

The tensors go through ``torch.distributed.checkpoint`` (DCP) keyed by parameter name: replicas of a stage
share the writing (DCP writes each name once), and loading picks, by name, whatever the stage holds now, so
a checkpoint written with one pipeline shape loads with any other. Rank 0 adds Lightning's training state
and, last, the commit marker (see `lightning_varuna.checkpoint.layout`).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.optim import Optimizer

from lightning_varuna.checkpoint.layout import (
    COMMIT_MARKER,
    DCP_INDEX,
    LIGHTNING_STATE,
    SET_ASIDE,
    CheckpointInfo,
    IncompleteCheckpointError,
    new_version,
    open_complete,
    versions,
)
from lightning_varuna.checkpoint.pieces import write_pieces
from lightning_varuna.checkpoint.state import destination_for, stage_tensors
from lightning_varuna.checkpoint.uploads import BackgroundUploads
from lightning_varuna.storage import REMOTE_WRITE_THREADS, Storage, join

__all__ = ["SavedTensors", "ShardedCheckpoints", "read_tensors", "read_training_state"]


class ShardedCheckpoints:
    """Collective save/load of sharded checkpoints at fsspec URLs; every rank of the job calls them alike.

    Args:
        storage: how to reach the URLs.
        tempdir: a fast local folder (per node). When set, a save writes there and returns; a worker thread
            uploads to the URL while training continues, and the commit follows once every rank's upload is
            done. The next save, load or `wait` waits for it.
        upload_timeout: seconds rank 0 waits for the other ranks' uploads before giving up the commit.
    """

    def __init__(self, storage: Storage, tempdir: str | None = None, upload_timeout: float = 1800.0) -> None:
        self.storage = storage
        self.tempdir = tempdir
        self.upload_timeout = upload_timeout
        self._uploads = BackgroundUploads()

    # ---------------------------------------------------------------------------------------------- save
    def save(
        self,
        tensors: dict[str, Any],
        lightning_state: dict[str, Any],
        url: str,
        shape: dict[str, Any],
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """Write ``tensors`` (this rank's part, keyed by name) and rank 0's ``lightning_state`` to ``url``."""
        self.wait()
        rank = dist.get_rank()
        storage = self.storage.with_options(storage_options)
        _agree(_error_of(lambda: _prepare_folder(storage, url)) if rank == 0 else None)
        info = _broadcast(_new_save(url, lightning_state, shape) if rank == 0 else None)
        if self.tempdir is None:
            dcp.save(tensors, storage_writer=storage.dcp_writer(info.version_url))
            _agree(_error_of(lambda: _commit(storage, info, _to_bytes(lightning_state))) if rank == 0 else None)
            return
        local = os.path.join(self.tempdir, info.version, f"rank{rank}")
        # As many files as a direct remote save writes, so that they upload concurrently.
        files = 1 if storage.is_local(info.version_url) else REMOTE_WRITE_THREADS
        dcp.save(tensors, storage_writer=FileSystemWriter(local, sync_files=False, thread_count=files))
        _agree(_error_of(lambda: _write_local(local, lightning_state)) if rank == 0 else None)
        store = dist.distributed_c10d._get_default_store()
        self._uploads.submit(self._upload, storage, local, info, store, rank, dist.get_world_size())

    def save_pieces(
        self,
        pieces: Iterable[dict[str, Any]],
        lightning_state: dict[str, Any],
        url: str,
        shape: dict[str, Any],
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """`save` in one process, from ``pieces`` (the nested tensors of ``save``, a part at a time, each part made
        once the previous one is written): a model that is never whole in memory is written without gathering."""
        self.wait()
        storage = self.storage.with_options(storage_options)
        _prepare_folder(storage, url)
        info = _new_save(url, lightning_state, shape)
        write_pieces(storage.dcp_writer(info.version_url), pieces)
        _commit(storage, info, _to_bytes(lightning_state))

    def _upload(
        self, storage: Storage, local: str, info: CheckpointInfo, store: dist.Store, rank: int, world_size: int
    ) -> None:
        """Worker thread: upload this rank's files; rank 0 then waits for all ranks and commits."""
        key = f"lightning_varuna/checkpoint/{info.version}"
        try:
            names = [name for name in sorted(os.listdir(local)) if name not in (DCP_INDEX, LIGHTNING_STATE)]

            def upload(name: str) -> None:
                storage.put_file(os.path.join(local, name), join(info.version_url, name))

            with ThreadPoolExecutor(REMOTE_WRITE_THREADS, thread_name_prefix="lightning-varuna-upload") as pool:
                list(pool.map(upload, names))  # raises the first failure
            store.add(f"{key}/uploaded", 1)
            if rank == 0:
                self._wait_for_ranks(store, key, world_size)
                storage.put_file(os.path.join(local, DCP_INDEX), join(info.version_url, DCP_INDEX))
                with open(os.path.join(local, LIGHTNING_STATE), "rb") as f:
                    _commit(storage, info, f.read())
        except BaseException:
            store.add(f"{key}/failed", 1)
            raise
        finally:
            shutil.rmtree(local, ignore_errors=True)
            _remove_if_empty(os.path.dirname(local))

    def _wait_for_ranks(self, store: dist.Store, key: str, world_size: int) -> None:
        deadline = time.monotonic() + self.upload_timeout
        while store.add(f"{key}/uploaded", 0) < world_size:
            if store.add(f"{key}/failed", 0):
                raise RuntimeError("Another rank failed to upload its part of the checkpoint; it was not committed.")
            if time.monotonic() > deadline:
                raise TimeoutError(f"The other ranks did not upload their checkpoint parts in {self.upload_timeout} s.")
            time.sleep(0.05)

    def remove(self, url: str) -> None:
        """Delete a checkpoint (rank 0 only), after the uploads already submitted."""
        if self.tempdir is None:
            self.storage.remove(url)
        else:
            self._uploads.submit(self.storage.remove, url)

    def wait(self, collective: bool = True) -> None:
        """Wait for the background uploads; raise on every rank if any rank's upload failed."""
        error = self._uploads.wait()
        if collective:
            _agree(error)
        elif error is not None:
            raise error

    # ---------------------------------------------------------------------------------------------- load
    def load(self, url: str, module: nn.Module, optimizers: list[Optimizer]) -> tuple[dict[str, Any], CheckpointInfo]:
        """Lightning's checkpoint dict for this rank: the training state plus this stage's tensors by name.

        ``checkpoint["state_dict"]`` holds this stage's entries of ``module.state_dict()``;
        ``checkpoint["optimizer_states"]`` (if saved) one by-name state per optimizer.
        """
        self.wait()
        result: Any = None
        error: BaseException | None = None
        try:
            result = self._read(url, module, optimizers)
        except Exception as err:
            error = err
        _agree(error)
        return result

    def _read(self, url: str, module: nn.Module, optimizers: list[Optimizer]) -> tuple[dict[str, Any], CheckpointInfo]:
        saved = SavedTensors(self.storage, url)
        return {**saved.training_state(), **stage_tensors(saved, module, optimizers)}, saved.info


class SavedTensors:
    """The committed checkpoint at ``url``, read a few tensors at a time by parameter name."""

    def __init__(self, storage: Storage, url: str) -> None:
        self.storage = storage
        self.info = open_complete(storage, url)
        self._reader = storage.dcp_reader(self.info.version_url)
        self._metadata = self._reader.read_metadata()

    @property
    def has_optimizer_state(self) -> bool:
        return any(key.startswith("optimizer.") for key in self._metadata.state_dict_metadata)

    def training_state(self) -> dict[str, Any]:
        """Lightning's training state: loops, LR schedulers, callbacks, precision."""
        return read_training_state(self.storage, self.info)

    def model(self, names: list[str]) -> dict[str, Tensor]:
        """The model's tensors (parameters and buffers) called ``names``."""
        model, missing = destination_for(self._metadata, "model", names)
        if missing:
            raise IncompleteCheckpointError(
                f"Checkpoint {self.info.version_url!r} has no values for {len(missing)} tensors of this model, e.g. "
                f"{missing[:3]}: it was written by a different model."
            )
        read_tensors(self._reader, {"model": model})
        return model

    def optimizer(self, index: int, names: list[str]) -> dict[str, dict[str, Any]]:
        """Optimizer ``index``'s state and hyper-parameters for the parameters ``names`` (as
        `optimizer_state_by_name` makes them)."""
        state, _ = destination_for(self._metadata, f"optimizer.{index}.state", names)
        groups, missing = destination_for(self._metadata, f"optimizer.{index}.param_groups", names)
        if missing:
            raise IncompleteCheckpointError(
                f"Checkpoint {self.info.version_url!r} has no state of optimizer {index} for {missing[:3]}: it was "
                "written with different optimizers."
            )
        read_tensors(self._reader, {"optimizer": {str(index): {"state": state, "param_groups": groups}}})
        return {"state": state, "param_groups": groups}


def read_tensors(reader: dcp.StorageReader, tensors: dict[str, Any]) -> None:
    """Fill ``tensors`` (a nested dict of destinations) from ``reader`` in this process alone."""
    with warnings.catch_warnings():  # in front of the user's filters (`-W error` too): the intent is as torch assumes
        warnings.filterwarnings("ignore", ".*assuming the intent is to load in a single process", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)


def read_training_state(storage: Storage, info: CheckpointInfo) -> dict[str, Any]:
    """Lightning's training state that rank 0 wrote with the committed save ``info``."""
    data = storage.read_bytes(join(info.version_url, LIGHTNING_STATE))
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _new_save(url: str, lightning_state: dict[str, Any], shape: dict[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(
        url=url,
        version=new_version(),
        global_step=int(lightning_state.get("global_step", 0)),
        epoch=int(lightning_state.get("epoch", 0)),
        saved_at=time.time(),
        shape=shape,
    )


def _prepare_folder(storage: Storage, url: str) -> None:
    """Rank 0, before a save to ``url``: a single-file checkpoint there (Lightning's ``last.ckpt`` of the run this one
    resumed) is set aside until the save commits, and the folder must be writable."""
    fs, path = storage.fs(url)
    if fs.isfile(path):
        fs.mv(path, path + SET_ASIDE)
    storage.check_writable(url)


def _commit(storage: Storage, info: CheckpointInfo, lightning_state: bytes) -> None:
    """Rank 0, once every tensor is stored: the training state, the commit marker, then drop the other saves
    in this folder (older ones, and interrupted ones whatever their clock said) and a single file set aside."""
    storage.write_bytes(join(info.version_url, LIGHTNING_STATE), lightning_state)
    storage.write_bytes(join(info.version_url, COMMIT_MARKER), info.marker())
    for version in versions(storage, info.url):
        if version != info.version:
            storage.remove(join(info.url, version))
    if storage.exists(info.url + SET_ASIDE):
        storage.remove(info.url + SET_ASIDE)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_local(local: str, lightning_state: dict[str, Any]) -> None:
    with open(os.path.join(local, LIGHTNING_STATE), "wb") as f:
        f.write(_to_bytes(lightning_state))


def _error_of(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except Exception as err:
        return err
    return None


def _agree(error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank had an error (its own error where it happened)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    messages: list[str | None] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(messages) if message]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"Checkpointing failed on rank {rank}: {message}")


def _broadcast(obj: Any) -> Any:
    objects = [obj]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def _remove_if_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)
