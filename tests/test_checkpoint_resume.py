"""A checkpoint written at one pipeline x data-parallel shape resumes at another and training continues
exactly as if it had never stopped (real processes, gloo; local folders and loopback S3 and Azure Blob servers)."""

from __future__ import annotations

import json
import os
import shutil

import lightning as L
import pytest
import torch
from conftest import fsspec_env, run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from models import fit_and_report, model_for, token_dataset
from reference import train_reference
from torch.utils.data import DataLoader
from upload_hooks import describe_store, step_of

from lightning_varuna import SpillingStrategy
from lightning_varuna.checkpoint.consolidate import consolidate
from lightning_varuna.checkpoint.layout import COMMIT_MARKER, IncompleteCheckpointError, open_complete
from lightning_varuna.storage import Storage

pytestmark = pytest.mark.slow  # real multi-process jobs

RUNNER = os.path.join(os.path.dirname(__file__), "run_pipelined.py")
GLOBAL_BATCH, ROWS, EPOCHS = 6, 18, 4  # 3 steps per epoch


def shape(pp: int, dp: int, schedule: str = "1f1b", **extra) -> dict:
    """A run at (P, D) with the same global batch: the DataLoader batch is GLOBAL_BATCH / D; ``extra`` adds to it
    or replaces its settings."""
    return {
        "pipeline_parallel_size": pp,
        "data_parallel_size": dp,
        "batch_size": GLOBAL_BATCH // dp,
        "micro_batch_size": 1 if GLOBAL_BATCH // dp < 4 else 2,
        "schedule": schedule,
        "rows": ROWS,
        "scheduler": True,
        **extra,
    }


def run(tmp_path, name: str, config: dict, env: dict | None = None, expect_ok: bool = True) -> tuple[dict, dict]:
    out = tmp_path / name
    processes = config["pipeline_parallel_size"] * config["data_parallel_size"]
    proc = run_ranks([RUNNER, str(out), json.dumps(config)], processes, tmp_path, env=env)
    if not expect_ok:
        return proc, {}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    weights = {}
    for rank in range(processes):
        weights.update(torch.load(out / f"rank{rank}.pt"))
    return json.loads((out / "losses.json").read_text()), weights


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-device training for all epochs on the same global batches: what every resumed run must match."""
    result, weights = train_reference(shape(1, 1, epochs=EPOCHS))
    return result["losses"], weights


@pytest.fixture(scope="module")
def written_at_2x2(tmp_path_factory) -> str:
    """Two epochs at (P, D) = (2, 2) with a ModelCheckpoint every epoch plus ``last``; returns its folder."""
    tmp_path = tmp_path_factory.mktemp("written_at_2x2")
    folder = str(tmp_path / "checkpoints")
    run(tmp_path, "first", shape(2, 2, epochs=2, checkpoint_dir=folder))
    return folder


def test_replicas_share_the_writing(written_at_2x2):
    """At (2, 2) every rank writes a part and each tensor is written once: no rank writes the whole model."""
    storage = Storage()
    info = open_complete(storage, os.path.join(written_at_2x2, "last.ckpt"))
    shards = {name: os.path.getsize(os.path.join(info.version_url, name)) for name in os.listdir(info.version_url)}
    shards = {name: size for name, size in shards.items() if name.endswith(".distcp")}
    assert sorted(shards) == [f"__{rank}_0.distcp" for rank in range(4)]
    assert all(size > 0 for size in shards.values())
    metadata = storage.dcp_reader(info.version_url).read_metadata()
    assert len({(i.relative_path, i.offset) for i in metadata.storage_data.values()}) == len(metadata.storage_data)
    assert max(shards.values()) < 0.5 * sum(shards.values())


def assert_continues(result: dict, weights: dict, uninterrupted, from_step: int) -> None:
    losses, final = uninterrupted
    assert len(result["losses"]) == len(losses) - from_step
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses[from_step:]), rtol=1e-5, atol=1e-5)
    assert weights.keys() == final.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, final[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("pp", "dp", "ckpt_path"),
    [(4, 1, "last"), (1, 2, "epoch=1-step=6.ckpt"), (1, 1, "last")],
    ids=["2x2-to-4x1-last", "2x2-to-1x2-named", "2x2-to-single-process"],
)
def test_resume_with_another_shape_continues_the_same_training(
    tmp_path, written_at_2x2, uninterrupted, pp, dp, ckpt_path
):
    folder = str(tmp_path / "checkpoints")
    shutil.copytree(written_at_2x2, folder)  # the resumed run saves there too
    resume = ckpt_path if ckpt_path == "last" else os.path.join(folder, ckpt_path)
    result, weights = run(tmp_path, "resumed", shape(pp, dp, epochs=EPOCHS, checkpoint_dir=folder, resume=resume))
    assert_continues(result, weights, uninterrupted, from_step=6)


def test_single_process_checkpoint_resumes_pipelined(tmp_path, uninterrupted):
    folder = str(tmp_path / "checkpoints")
    run(tmp_path, "first", shape(1, 1, epochs=1, checkpoint_dir=folder))
    result, weights = run(tmp_path, "resumed", shape(2, 1, epochs=EPOCHS, checkpoint_dir=folder, resume="last"))
    assert_continues(result, weights, uninterrupted, from_step=3)


@pytest.mark.parametrize("schedule", ["zero-bubble", "interleaved-1f1b", "zbv"])
def test_checkpoint_of_another_schedule_resumes_under_1f1b_at_another_depth_and_back(tmp_path, uninterrupted, schedule):
    """A checkpoint written under zero-bubble at 2 stages (or interleaved or ZBV: 4 stages on 2 ranks, round-robin or
    in a V) resumes under 1F1B at 4, whose checkpoint resumes under the first schedule at 2 again: each run continues
    the single-device training."""
    folder = str(tmp_path / "checkpoints")
    run(tmp_path, schedule, shape(2, 1, schedule, epochs=1, checkpoint_dir=folder))
    result, weights = run(tmp_path, "1f1b", shape(4, 1, epochs=2, checkpoint_dir=folder, resume="last"))
    assert result["losses"] == pytest.approx(uninterrupted[0][3:6], rel=1e-5, abs=1e-5)
    result, weights = run(tmp_path, "back", shape(2, 1, schedule, epochs=EPOCHS, checkpoint_dir=folder, resume="last"))
    assert_continues(result, weights, uninterrupted, from_step=6)


def test_consolidated_checkpoint_resumes_a_plain_trainer(tmp_path, written_at_2x2, uninterrupted):
    """`lightning-varuna consolidate` of a checkpoint written at (2, 2) is a plain Lightning checkpoint: a Trainer
    without this package's strategies resumes from it (torch's numbering of the optimizer state included, over the
    whole model's parameter groups and its tied weight) and trains on as the uninterrupted run."""
    consolidated = tmp_path / "model.ckpt"
    torch.save(consolidate(os.path.join(written_at_2x2, "epoch=1-step=6.ckpt")), consolidated)
    assert "optimizer_states_by_name" not in torch.load(consolidated, weights_only=False)
    result, weights = train_reference(shape(1, 1, epochs=EPOCHS), ckpt_path=str(consolidated), first_epoch=2)
    assert_continues(result, weights, uninterrupted, from_step=6)


def fit_spilled(config: dict, ckpt_path: str | None = None, **kwargs) -> tuple[dict, dict]:
    """Train as `run` does, in this process on one device with SpillingStrategy (two or more shards)."""
    L.seed_everything(config.get("seed", 0))
    model = model_for(config)
    strategy = SpillingStrategy(memory_budget="65KB")  # 5 shards: TinyLM needs 84 KB whole at batches of 6
    loader = DataLoader(token_dataset(config["rows"]), batch_size=config["batch_size"], shuffle=True)
    _, result = fit_and_report(
        model, loader, config, predict=False, ckpt_path=ckpt_path, devices=1, strategy=strategy, **kwargs
    )
    assert len(strategy.shards) >= 2
    return result, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_spilled_checkpoint_resumes_pipelined_and_back(tmp_path, uninterrupted):
    """A checkpoint SpillingStrategy writes mid-epoch resumes at (2, 2) exactly, and one written at (2, 2) mid-epoch
    resumes spilled exactly: the same format, the same data order and position."""
    folder = str(tmp_path / "spilled")
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=4, save_top_k=-1)
    result, _ = fit_spilled(shape(1, 1, epochs=EPOCHS, max_steps=4), callbacks=[saves])
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(uninterrupted[0][:4]), rtol=1e-5, atol=1e-5)
    spilled_checkpoint = os.path.join(folder, "epoch=1-step=4.ckpt")
    result, weights = run(tmp_path, "pipelined", shape(2, 2, epochs=EPOCHS, resume=spilled_checkpoint))
    assert_continues(result, weights, uninterrupted, from_step=4)

    pipelined_checkpoint = str(tmp_path / "pipelined.ckpt")
    run(tmp_path, "first", shape(2, 2, epochs=EPOCHS, max_steps=5, save_to=pipelined_checkpoint))
    result, weights = fit_spilled(shape(1, 1, epochs=EPOCHS), ckpt_path=pipelined_checkpoint)
    assert_continues(result, weights, uninterrupted, from_step=5)


def test_background_upload_to_object_store_resumes_with_another_shape(tmp_path, object_store, uninterrupted):
    folder, tempdir = f"{object_store.url}/run/checkpoints", tmp_path / "local"
    env = object_store.env  # how Lightning's ModelCheckpoint (fsspec) reaches the server
    run(tmp_path, "first", shape(4, 1, epochs=2, checkpoint_dir=folder, tempdir=str(tempdir)), env=env)
    assert not any(tempdir.rglob("*.distcp")), "uploaded local files are removed"
    storage = Storage(object_store.options)
    info = open_complete(storage, f"{folder}/last.ckpt")
    assert (info.global_step, info.shape["pipeline_parallel_size"]) == (6, 4)
    # After the fit, validate(ckpt_path="last") reads the checkpoint that the fit wrote last, on every rank.
    config = shape(2, 1, epochs=EPOCHS, checkpoint_dir=folder, resume="last", evaluate=True, validate_last=True)
    result, weights = run(tmp_path, "resumed", config, env=env)
    assert_continues(result, weights, uninterrupted, from_step=6)
    assert result["val_loss_last"] == pytest.approx(result["val_loss"], rel=1e-6)


def test_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, uninterrupted):
    folder = str(tmp_path / "checkpoints")
    config = shape(2, 1, epochs=2, checkpoint_dir=folder, kill_in_save={"rank": 1, "step": 6})
    proc, _ = run(tmp_path, "killed", config, expect_ok=False)
    assert proc.returncode != 0
    interrupted = os.path.join(folder, "epoch=1-step=6.ckpt")
    [version] = os.listdir(interrupted)
    assert COMMIT_MARKER not in os.listdir(os.path.join(interrupted, version))
    with pytest.raises(IncompleteCheckpointError, match="stopped while writing"):
        open_complete(Storage(), interrupted)

    result, weights = run(tmp_path, "resumed", shape(2, 1, epochs=EPOCHS, checkpoint_dir=folder, resume="last"))
    assert_continues(result, weights, uninterrupted, from_step=3)


def test_pruning_never_touches_an_upload_in_flight(tmp_path, s3_server, s3_bucket, uninterrupted):
    """ModelCheckpoint keeps the 2 newest of a save after every step, uploaded in the background to S3. Every upload
    is held in flight (after its first file) while rank 0 looks at the store, and the store is looked at again at
    every prune: the checkpoint to be pruned stays complete until the next one is committed, and the folder always
    holds a complete, loadable checkpoint."""
    folder, env = f"{s3_bucket}/run/checkpoints", fsspec_env("s3", s3_server)
    every_step = {"dirpath": folder, "save_top_k": 2}
    config = shape(2, 1, epochs=2, tempdir=str(tmp_path / "local"), checkpoint_every_step=every_step)
    run(tmp_path, "first", {**config, "watch_uploads": True}, env=env)
    log = json.loads((tmp_path / "first" / "uploads.json").read_text())

    def name(step: int) -> str:
        return f"epoch={(step - 1) // 3}-step={step}.ckpt"

    def loads(store: dict) -> dict[str, int | None]:
        return {checkpoint: entry["loads_step"] for checkpoint, entry in store.items()}

    held = [entry for entry in log if "held" in entry]
    assert [entry["step"] for entry in held] == [1, 2, 3, 4, 5, 6]  # a save after every step, each observed
    for entry in held:
        step = entry["step"]
        assert step_of(entry["held"]) == step
        # The save in flight is there but not loadable; the previous two (one about to be pruned) load.
        expected = {name(s): s for s in range(max(1, step - 2), step)}
        assert loads(entry["store"]) == {**expected, name(step): None}, entry

    pruned = [entry for entry in log if "pruned" in entry]
    assert [step_of(entry["pruned"]) for entry in pruned] == [1, 2, 3, 4]
    for entry in pruned:
        step = step_of(entry["pruned"])
        # Pruned only once the newest save is committed: the two to keep load, nothing is half written.
        assert loads(entry["store"]) == {name(s): s for s in (step, step + 1, step + 2)}, entry
        assert all(len(checkpoint["versions"]) == 1 for checkpoint in entry["store"].values()), entry

    assert loads(describe_store(Storage(s3_server), folder)) == {name(5): 5, name(6): 6}
    result, weights = run(tmp_path, "resumed", {**config, "epochs": EPOCHS, "resume": "last"}, env=env)
    assert_continues(result, weights, uninterrupted, from_step=6)


def test_a_failed_upload_prunes_nothing(tmp_path, s3_server, s3_bucket):
    """save_top_k=1 with the background upload: when a rank's upload of the newest save fails, the prune queued
    behind it does not run, so the previous checkpoint stays, complete."""
    folder, env = f"{s3_bucket}/run/checkpoints", fsspec_env("s3", s3_server)
    config = shape(
        2,
        1,
        epochs=2,
        tempdir=str(tmp_path / "local"),
        checkpoint_every_step={"dirpath": folder, "save_top_k": 1},
        fail_upload={"rank": 1, "step": 3},
    )
    proc, _ = run(tmp_path, "failed", config, env=env, expect_ok=False)
    assert proc.returncode != 0
    assert "test: the upload of" in proc.stderr
    store = describe_store(Storage(s3_server), folder)
    assert {name: entry["loads_step"] for name, entry in store.items()} == {
        "epoch=0-step=2.ckpt": 2,
        "epoch=0-step=3.ckpt": None,  # interrupted: ignored
    }
