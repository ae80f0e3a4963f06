"""SpillingStrategy's disk tier (`spill_dir`): only a model cut into shards is spilled there; a folder that does
not exist is made and removed, one that cannot be written or has no room is refused at set-up, and a disk that fills
up during training fails naming the file, with the newest checkpoint complete."""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyLM
from spilled_runs import BUDGETS, assert_same_model, fit, losses

from lightning_varuna import SpillingStrategy
from lightning_varuna.checkpoint.layout import find_newest
from lightning_varuna.storage import Storage


class SpillFiles(L.Callback):
    """The names of the files in the spill tier under ``folder`` after each training batch."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen = folder, []

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(sorted(p.name for p in self.folder.rglob("*.bin")))


@pytest.mark.parametrize("shards", [1, 5])
def test_only_a_model_cut_into_shards_is_spilled(tmp_path, shards):
    """A model that fits its budget in one shard stays in the device's memory, as in plain training: nothing of it
    goes to the spill tier (here the disk); one cut into shards has every shard there between its turns."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto")
    files = SpillFiles(tmp_path)
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[shards], spill_dir=tmp_path), callbacks=[files])
    assert len(files.seen) == 8
    if shards == 1:
        assert files.seen == [[]] * 8
    else:
        assert all({f"shard{k}.params.bin" for k in range(shards)} <= set(seen) for seen in files.seen)
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


def test_a_spill_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(OSError, match=r"spill_dir=.*file/spill.*is not a folder this process can write"):
        fit(model, SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=blocker / "spill"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name])


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 256 KiB filesystem (tmpfs) for a `spill_dir`; skips where this process may not mount one (not root)."""
    path = tmp_path / "small"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small filesystem: {mounted.stderr.decode().strip()}")
    yield path
    # Lazily: a model trained there keeps its parameters mapped from its (removed) spill files until it is freed.
    subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """Write a file on ``disk`` until it is full (but for about ``leave`` bytes), as another program could."""
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while shutil.disk_usage(disk).free > leave:
            f.write(b"x" * 4096)
            f.flush()


def test_a_spill_dir_without_room_fails_at_set_up(small_disk):
    fill(small_disk, leave=16 * 1024)
    with pytest.raises(OSError, match=r"spill_dir=.*small.* has 1[26]\.0 KiB free, but .* need up to 2\d\.\d KiB"):
        fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=small_disk), max_steps=1)
    assert not list(small_disk.rglob("*.bin"))


class FillDisk(L.Callback):
    """Fill ``disk`` after optimizer step ``step``."""

    def __init__(self, disk: Path, step: int) -> None:
        self.disk, self.step = disk, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not (self.disk / "filler").exists():
            fill(self.disk)


def test_a_spill_dir_that_fills_up_fails_with_the_path_and_loses_nothing(tmp_path, small_disk):
    """The spill write that finds the disk full fails the fit naming the file and the bytes; the newest
    checkpoint is complete and training resumes from it exactly (here spilled to host memory)."""
    torch.manual_seed(0)
    model = TinyLM()
    resumed, uninterrupted = copy.deepcopy(model), copy.deepcopy(model)
    folder = tmp_path / "checkpoints"
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=small_disk)
    with pytest.raises(OSError, match=r"Cannot spill \d+ bytes to `.*small/spill-.*\.bin` \(No space left on device\)"):
        fit(model, strategy, max_steps=4, callbacks=[saves, FillDisk(small_disk, step=2)])
    newest, _ = find_newest(Storage(), [str(folder)])
    assert newest is not None and newest.global_step in (1, 2)
    expected = fit(uninterrupted, "auto", max_steps=4)
    continued = fit(resumed, SpillingStrategy(memory_budget=BUDGETS[5]), ckpt_path=newest.url, max_steps=4)
    batches = 2 * newest.global_step  # two batches a step
    torch.testing.assert_close(losses(continued), losses(expected)[batches:], rtol=1e-5, atol=1e-6)
    assert_same_model(resumed, uninterrupted)


def test_a_spill_dir_that_does_not_exist_is_made_said_and_removed(tmp_path, caplog):
    spill_dir = tmp_path / "made" / "for" / "spills"
    with caplog.at_level(logging.INFO):
        fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=spill_dir), max_steps=1)
    assert any("made the folder" in m and str(spill_dir) in m for m in caplog.messages)
    assert not (tmp_path / "made").exists()


def test_a_spill_dir_made_for_a_refused_budget_is_removed(tmp_path):
    spill_dir = tmp_path / "made"
    with pytest.raises(ValueError, match="too small"):
        fit(TinyLM(), SpillingStrategy(memory_budget="20KB", spill_dir=spill_dir), max_steps=1)
    assert not spill_dir.exists()


def test_what_else_is_put_in_a_made_spill_dir_stays(tmp_path):
    spill_dir = tmp_path / "made"

    class PutAFile(L.Callback):
        def on_train_start(self, *args: Any) -> None:
            (spill_dir / "notes.txt").write_text("mine")

    fit(TinyLM(), SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=spill_dir), max_steps=1, callbacks=[PutAFile()])
    assert [p.name for p in spill_dir.iterdir()] == ["notes.txt"]
