"""Train `TinyLM` with VarunaStrategy in real processes and write what the parity tests compare.

    python tests/run_pipelined.py OUT_DIR '{"pipeline_parallel_size": 2, ...}'

Writes ``OUT_DIR/losses.json`` (rank 0: the logged train loss of every step) and ``OUT_DIR/rank{r}.pt``
(each rank's parameters by name). With ``"checkpoint_dir"`` in the config, a ModelCheckpoint saves there
every epoch (and ``last``); ``"resume"`` is passed to ``fit(ckpt_path=...)``; ``"validate_last"`` validates
from ``ckpt_path="last"`` after the fit (``val_loss_last`` in losses.json); ``"save_to"`` saves the final
state with ``trainer.save_checkpoint``; ``"trace"`` writes a `PipelineTrace` of steps 1 and 2 there.
``"kill_in_save": {"rank": r, "step": s}`` makes rank ``r`` SIGKILL
itself in the middle of the save at global step ``s``, right after writing its shard.
``"checkpoint_every_step": {"dirpath": url, "save_top_k": k}`` adds a ModelCheckpoint that saves after every step
and keeps the k newest; ``"watch_uploads": true`` holds each of its background uploads in flight while rank 0 looks
at the store (`upload_hooks.WatchUploads`; what it saw goes to ``OUT_DIR/uploads.json``);
``"fail_upload": {"rank": r, "step": s}`` makes rank ``r``'s upload of the save at step ``s`` fail.
``"max_steps"`` ends the fit after that many optimizer steps; ``"validate_during_fit"`` validates at every epoch end.
``"devices"`` and ``"num_nodes"`` go to the Trainer (default: one node with a process per rank).
``"accelerator": "gpu"`` runs every rank on the one GPU (``Trainer(accelerator="gpu", devices=1)``, the strategy's
``parallel_devices`` the GPU once per rank: its processes share it over gloo).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from models import fit_and_report, model_for, token_dataset  # noqa: E402
from upload_hooks import FailUpload, WatchUploads  # noqa: E402

from lightning_varuna import PipelineTrace, VarunaStrategy  # noqa: E402


class KillInSave(L.Callback):
    """SIGKILL this process inside the checkpoint save at ``step``, after its tensors reached storage."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        write_data = FileSystemWriter.write_data

        def write_then_die(writer, plan, planner):  # noqa: ANN001, ANN202
            written = write_data(writer, plan, planner)
            if trainer.global_step == self.step:
                written.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        FileSystemWriter.write_data = write_then_die


def main(out_dir: str, config: dict) -> None:
    L.seed_everything(config.get("seed", 0))
    model = model_for(config)
    pp, dp = config["pipeline_parallel_size"], config["data_parallel_size"]
    shares_a_gpu = config.get("accelerator") == "gpu"
    strategy = VarunaStrategy(
        parallel_devices=[torch.device("cuda", 0)] * pp * dp if shares_a_gpu else None,
        pipeline_parallel_size=pp,
        micro_batch_size=config.get("micro_batch_size"),
        schedule=config["schedule"],
        stages_per_rank=config.get("stages_per_rank"),
        checkpoint_tempdir=config.get("tempdir"),
        storage_options=config.get("storage_options"),
        profile=config.get("profile"),
        global_batch_size=config.get("global_batch_size"),
    )
    loader = DataLoader(token_dataset(config["rows"]), batch_size=config["batch_size"])
    callbacks = []
    if "trace" in config:
        callbacks.append(PipelineTrace(config["trace"], step=1, steps=2))
    if "kill_in_save" in config:
        callbacks.append(KillInSave(**config["kill_in_save"]))
    if "checkpoint_dir" in config:
        callbacks.append(
            ModelCheckpoint(dirpath=config["checkpoint_dir"], every_n_epochs=1, save_top_k=-1, save_last=True)
        )
    if "checkpoint_every_step" in config:
        dirpath, top_k = config["checkpoint_every_step"]["dirpath"], config["checkpoint_every_step"]["save_top_k"]
        monitor = "step" if top_k > 1 else None  # the k newest
        callbacks.append(ModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=top_k, monitor=monitor, mode="max"))
        if config.get("watch_uploads"):
            watch = WatchUploads(dirpath)
            callbacks.append(watch)
    if "fail_upload" in config:
        callbacks.append(FailUpload(**config["fail_upload"]))
    # With one replica, rank 0's predictions cover the whole set.
    trainer, result = fit_and_report(
        model,
        loader,
        config,
        predict=dp == 1,
        callbacks=callbacks,
        ckpt_path=config.get("resume"),
        devices=1 if shares_a_gpu else config.get("devices") or pp * dp,
        num_nodes=config.get("num_nodes", 1),
        strategy=strategy,
    )
    if config.get("validate_last"):
        loader = DataLoader(token_dataset(config["rows"], seed=2), batch_size=config["batch_size"])
        result["val_loss_last"] = trainer.validate(model, loader, ckpt_path="last", verbose=False)[0]["val_loss"]
    if "save_to" in config:
        trainer.save_checkpoint(config["save_to"])
    os.makedirs(out_dir, exist_ok=True)
    if config.get("watch_uploads") and trainer.is_global_zero:
        with open(f"{out_dir}/uploads.json", "w") as f:
            json.dump(watch.events, f)
    torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, f"{out_dir}/rank{trainer.global_rank}.pt")
    if trainer.is_global_zero:
        topology = trainer.strategy.topology
        result["shape"] = [topology.pipeline_parallel_size, topology.data_parallel_size, strategy.micro_batch_size]
        result["schedule"] = strategy.schedule
        result["stages_per_rank"] = topology.stages_per_rank
        result["device"] = str(trainer.strategy.root_device)
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
