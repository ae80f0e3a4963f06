"""Checkpoints in one process: fsspec URLs, clear errors for bad or damaged checkpoints and unreachable
stores, state keyed by parameter name, consolidation into a plain Lightning checkpoint."""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import lightning as L
import pytest
import torch
import torch.distributed.checkpoint
from conftest import AZURITE_KEY, azurite_connection_string, clean_env
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyLM, token_dataset
from ports import free_port
from torch import nn
from torch.utils.data import DataLoader

from lightning_varuna import SpillingStrategy, VarunaStrategy
from lightning_varuna.checkpoint.layout import COMMIT_MARKER, IncompleteCheckpointError, find_newest
from lightning_varuna.checkpoint.sharded import read_tensors
from lightning_varuna.checkpoint.state import load_optimizer_state_by_name, optimizer_state_by_name
from lightning_varuna.storage import Storage
from lightning_varuna.storage.range_reader import RangeReader


def trainer(**kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**options, **kwargs})


def loader() -> DataLoader:
    return DataLoader(token_dataset(12), batch_size=4)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def trained() -> tuple[TinyLM, L.Trainer]:
    L.seed_everything(0)
    model = TinyLM()
    fitted = trainer(strategy=VarunaStrategy(micro_batch_size=2))
    fitted.fit(model, loader())
    return model, fitted


def load_into_fresh_model(url: str, **strategy_kwargs) -> TinyLM:
    L.seed_everything(1)
    fresh = TinyLM()
    trainer(strategy=VarunaStrategy(micro_batch_size=2, **strategy_kwargs)).validate(fresh, loader(), ckpt_path=url)
    return fresh


@pytest.mark.parametrize("scheme", ["memory://", "file://"])
def test_url_round_trip(trained, tmp_path, scheme):
    model, fitted = trained
    url = f"memory://checkpoints/{tmp_path.name}.ckpt" if scheme == "memory://" else f"file://{tmp_path}/x.ckpt"
    fitted.save_checkpoint(url)
    fresh = load_into_fresh_model(url)
    torch.testing.assert_close(weights(fresh), weights(model), rtol=0, atol=0)


def test_damaged_checkpoints_fail_naming_what_is_missing(trained, tmp_path):
    _, fitted = trained
    url = str(tmp_path / "model.ckpt")
    fitted.save_checkpoint(url)
    [version] = os.listdir(url)
    folder = os.path.join(url, version)

    shard = next(name for name in os.listdir(folder) if name.endswith(".distcp"))
    os.rename(os.path.join(folder, shard), os.path.join(tmp_path, shard))
    with pytest.raises(IncompleteCheckpointError, match=f"{shard} is missing"):
        load_into_fresh_model(url)

    # Cut short, as by a full disk or a copy that stopped: refused, naming the file.
    data = (tmp_path / shard).read_bytes()
    Path(folder, shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(IncompleteCheckpointError, match=f"{shard} holds {len(data) // 2} of its {len(data)} bytes"):
        load_into_fresh_model(url)

    os.remove(os.path.join(folder, COMMIT_MARKER))
    with pytest.raises(IncompleteCheckpointError, match=f"{version}.*have no {COMMIT_MARKER}"):
        load_into_fresh_model(url)

    with pytest.raises(IncompleteCheckpointError, match="does not exist"):
        load_into_fresh_model(str(tmp_path / "never-written.ckpt"))


def test_overwriting_keeps_one_version_and_last_skips_interrupted_saves(trained, tmp_path):
    model, fitted = trained
    folder = tmp_path / "checkpoints"
    fitted.save_checkpoint(folder / "a.ckpt")
    time.sleep(0.01)
    fitted.save_checkpoint(folder / "b.ckpt")
    fitted.save_checkpoint(folder / "b.ckpt")
    assert len(os.listdir(folder / "b.ckpt")) == 1, "a committed save replaces the older version"
    # An interrupted save into a.ckpt after b.ckpt: a version folder without a commit marker.
    [committed] = os.listdir(folder / "a.ckpt")
    shutil.copytree(folder / "a.ckpt" / committed, folder / "a.ckpt" / "v99999999999999999999")
    os.remove(folder / "a.ckpt" / "v99999999999999999999" / COMMIT_MARKER)

    newest, interrupted = find_newest(Storage(), [str(folder)])
    assert newest is not None and newest.url == str(folder / "b.ckpt")
    assert interrupted == [str(folder / "a.ckpt" / "v99999999999999999999")]
    # Loading a.ckpt explicitly reads its newest complete version.
    torch.testing.assert_close(weights(load_into_fresh_model(str(folder / "a.ckpt"))), weights(model))


def assert_first_save_fails(
    trained: tuple[TinyLM, L.Trainer], tmp_path: Path, url: str, options: dict, match: str
) -> None:
    """Saving to ``url`` fails with an error matching ``match``; the model is untouched and local saves work."""
    model, fitted = trained
    before = weights(model)
    with pytest.raises(OSError, match=match):
        fitted.save_checkpoint(url, storage_options=options)
    torch.testing.assert_close(weights(model), before, rtol=0, atol=0)
    fitted.save_checkpoint(tmp_path / "after.ckpt")  # still works
    torch.testing.assert_close(weights(load_into_fresh_model(str(tmp_path / "after.ckpt"))), before)


@pytest.mark.slow  # waits out a storage timeout
def test_unreachable_store_fails_at_the_first_save_and_training_state_survives(trained, tmp_path):
    port = free_port()  # nobody listens there
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "k",
        "secret": "s",
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    pytest.importorskip("s3fs")
    match = f"Cannot write checkpoints to 's3://bucket/run/x.ckpt'.*127.0.0.1:{port}"
    assert_first_save_fails(trained, tmp_path, "s3://bucket/run/x.ckpt", options, match)


def test_wrong_azure_key_fails_at_the_first_save_and_training_state_survives(
    trained, tmp_path, azure_server, azure_container
):
    url = f"{azure_container}/run/x.ckpt"
    options = {"connection_string": azure_server["connection_string"].replace(AZURITE_KEY, "d3Jvbmcga2V5")}
    match = f"(?s)Cannot write checkpoints to '{re.escape(url)}'.*AuthorizationFailure"
    assert_first_save_fails(trained, tmp_path, url, options, match)


@pytest.mark.slow  # waits out a storage timeout
def test_a_store_that_never_answers_times_out():
    pytest.importorskip("s3fs")
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        storage = Storage({"endpoint_url": endpoint, "key": "k", "secret": "s"}, timeout=2)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer within 2 s"):
            storage.check_writable("s3://bucket/run")
        assert time.monotonic() - start < 10


@pytest.mark.slow  # waits out a storage timeout
def test_a_refused_azure_connection_ends_at_the_timeout():
    """Azure's SDK retries a refused connection for ~90 s: the storage timeout ends the wait."""
    pytest.importorskip("adlfs")
    storage = Storage({"connection_string": azurite_connection_string(free_port())}, timeout=2)
    with pytest.raises(TimeoutError, match="Checkpoint storage 'az://bucket/run' did not answer within 2 s"):
        storage.check_writable("az://bucket/run")


def test_object_store_url_with_storage_options(trained, object_store):
    model, _ = trained
    url = f"{object_store.url}/run/model.ckpt"
    fitted = trainer(strategy=VarunaStrategy(micro_batch_size=2, storage_options=object_store.options))
    fitted.fit(model, loader())
    fitted.save_checkpoint(url)
    fresh = load_into_fresh_model(url, storage_options=object_store.options)
    torch.testing.assert_close(weights(fresh), weights(model), rtol=0, atol=0)


class TrainedBatches(L.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args) -> None:
        self.count += 1


@pytest.mark.parametrize(
    "strategy",
    [
        lambda options: VarunaStrategy(micro_batch_size=2, storage_options=options),
        lambda options: SpillingStrategy(memory_budget="48KB", storage_options=options),  # cut: it needs 65 KB whole
    ],
    ids=["varuna", "spilled"],
)
@pytest.mark.slow  # trains against the S3 server
def test_last_from_the_default_folder_on_s3(s3_bucket, s3_server, monkeypatch, strategy):
    """A ModelCheckpoint without a `dirpath` writes under `default_root_dir`, here on S3; `fit(ckpt_path="last")`
    resumes from the newest complete checkpoint there, and trains as an uninterrupted run (before, both strategies
    trained from scratch, with Lightning's warning that there was no last checkpoint)."""
    monkeypatch.setitem(fsspec.config.conf, "s3", s3_server)  # for Lightning's own file operations

    def fit(max_steps: int, ckpt_path: str | None = None, saves: bool = True) -> tuple[TinyLM, TrainedBatches]:
        L.seed_everything(0)
        model, trained = TinyLM(), TrainedBatches()
        callbacks = [trained, *([ModelCheckpoint(save_last=True)] if saves else [])]
        options = dict(max_epochs=-1, max_steps=max_steps, enable_checkpointing=saves, callbacks=callbacks)
        trainer(strategy=strategy(s3_server), default_root_dir=f"{s3_bucket}/run", **options).fit(
            model, loader(), ckpt_path=ckpt_path
        )
        return model, trained

    fit(max_steps=2)
    resumed, trained = fit(max_steps=5, ckpt_path="last")
    uninterrupted, _ = fit(max_steps=5, saves=False)
    assert trained.count == 3
    torch.testing.assert_close(weights(resumed), weights(uninterrupted), rtol=1e-5, atol=1e-6)


def test_listings_show_what_other_processes_changed(object_store):
    """Other ranks and jobs add and delete checkpoint versions: what a Storage lists is never a cached view."""
    storage = Storage(object_store.options)
    storage.write_bytes(f"{object_store.url}/last.ckpt/v1/{COMMIT_MARKER}", b"{}")
    assert storage.children(f"{object_store.url}/last.ckpt") == ["v1"]
    other = Storage({**object_store.options, "skip_instance_cache": True})  # as in another process
    other.write_bytes(f"{object_store.url}/last.ckpt/v2/{COMMIT_MARKER}", b"{}")
    other.remove(f"{object_store.url}/last.ckpt/v1")
    assert storage.children(f"{object_store.url}/last.ckpt") == ["v2"]
    assert not storage.exists(f"{object_store.url}/last.ckpt/v1/{COMMIT_MARKER}")


def test_reads_back_in_small_windows_files_written_by_several_threads(object_store):
    """On an object store DCP writes several files per rank (items grouped by size, not in state-dict order); read
    in windows smaller than some items, several requested at once, every tensor and value comes back as saved."""
    storage = Storage(object_store.options)
    url = f"{object_store.url}/run/tensors"
    torch.manual_seed(0)
    saved = {f"layer{i}.weight": torch.randn(1 + 7 * i, 33) for i in range(12)}  # 132 B to 10 KB each
    saved["layer3.lr"] = 0.25
    torch.distributed.checkpoint.save(saved, storage_writer=storage.dcp_writer(url), no_dist=True)
    assert sum(name.endswith(".distcp") for name in storage.children(url)) == 4
    loaded = {name: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for name, v in saved.items()}
    read_tensors(RangeReader(url, window_bytes=4096, prefetch=3, **storage.fs_options), loaded)
    torch.testing.assert_close(loaded, saved, rtol=0, atol=0)


@pytest.mark.slow  # the CLI in a Python process of its own
def test_consolidated_checkpoint_loads_without_the_strategy(trained, tmp_path):
    model, fitted = trained
    fitted.save_checkpoint(tmp_path / "sharded.ckpt")
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_varuna.cli", "consolidate", tmp_path / "sharded.ckpt", tmp_path / "one.ckpt"],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "global step 3" in proc.stdout
    plain = TinyLM.load_from_checkpoint(tmp_path / "one.ckpt")
    torch.testing.assert_close(weights(plain), weights(model), rtol=0, atol=0)
    assert torch.load(tmp_path / "one.ckpt", weights_only=False)["global_step"] == 3


def test_optimizer_state_moves_by_name_between_differently_cut_optimizers():
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    stage = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    stage.load_state_dict(whole.state_dict())
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    for _ in range(2):
        whole(torch.randn(4, 3)).sum().backward()
        whole_optimizer.step()
        whole_optimizer.zero_grad()
    stage.load_state_dict(whole.state_dict())
    # A "stage" holding the last two layers, built with other hyper-parameters, gets the saved ones by name.
    stage_optimizer = torch.optim.AdamW([*stage[1].parameters(), *stage[2].parameters()], lr=0.5)
    saved = copy.deepcopy(optimizer_state_by_name(whole_optimizer, whole))  # as if read back from storage
    load_optimizer_state_by_name(stage_optimizer, stage, saved)
    assert stage_optimizer.param_groups[0]["lr"] == 0.1
    x = torch.randn(4, 3)
    for model, optimizer in ((whole, whole_optimizer), (stage, stage_optimizer)):
        model(x).sum().backward()
        optimizer.step()
    for name, value in stage[1:].state_dict().items():
        torch.testing.assert_close(value, whole[1:].state_dict()[name])
