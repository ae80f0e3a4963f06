"""The disk tier's folder: a fresh sub-folder of the user's ``spill_dir``, removed after training with any folders
made for it."""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_varuna.partition.packing import format_bytes

__all__ = ["SpillFolder"]


class SpillFolder:
    """A fresh folder in ``spill_dir`` with ``needed`` bytes free there. ``spill_dir`` is made if it does not exist
    (the log says so), and `cleanup` removes what was made: the fresh folder, and ``spill_dir`` and its parents that
    did not exist before, if nothing else was put there meanwhile."""

    def __init__(self, spill_dir: Path, needed: int) -> None:
        self.spill_dir = spill_dir
        self._made = _missing_folders(spill_dir)
        try:
            spill_dir.mkdir(parents=True, exist_ok=True)
            self._fresh = tempfile.TemporaryDirectory(prefix="spill-", dir=spill_dir)
        except OSError as error:
            self._remove_made()
            raise OSError(
                f"`SpillingStrategy(spill_dir={str(spill_dir)!r})` is not a folder this process can write "
                f"to ({error.strerror}). Pass a writable folder, or `spill_dir=None` to spill to host memory."
            ) from error
        if self._made:
            rank_zero_info(
                f"SpillingStrategy: made the folder `{spill_dir}` for spilled shards (`spill_dir` did not exist); it "
                "is removed after training if nothing else is put there."
            )
        free = shutil.disk_usage(spill_dir).free
        if free < needed:
            self.cleanup()
            raise OSError(
                errno.ENOSPC,
                f"`SpillingStrategy(spill_dir={str(spill_dir)!r})` has {format_bytes(free)} free, but the model's "
                f"parameters, gradients and optimizer state need up to {format_bytes(needed)} ({needed} bytes) there. "
                "Free space, pick a `spill_dir` on a larger disk, or pass `spill_dir=None` to spill to host memory.",
            )

    @property
    def name(self) -> str:
        """The fresh folder's path."""
        return self._fresh.name

    def cleanup(self) -> None:
        """Remove the fresh folder, and the folders made for it that are empty."""
        self._fresh.cleanup()
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self._made:  # the deepest first
            try:
                folder.rmdir()
            except OSError:  # not empty (something else was put there), or already gone
                return
        self._made = []


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist, the deepest first."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing
