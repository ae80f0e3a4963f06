"""Models users bring, pipelined at two or more shapes, train like one device (real processes, gloo).

The models are in `real_models` (Hugging Face ResNet, ViT, BERT, GPT-2, Llama, T5 and Mixtral (whose experts
compute the tokens their router picks), Lightning's demo Transformer, an ``nn.TransformerEncoder`` and an MLP with
BatchNorm). The single-device reference trains the same global batches
(Lightning's DistributedSampler shuffles them) and runs each batch as the same micro-batches, so that BatchNorm sees
the batches the pipeline's stages see; every rank's parameters and buffers (BatchNorm's running statistics too) must
equal the reference's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import run_ranks
from models import RecordLosses
from torch.utils.data import DataLoader, DistributedSampler

from lightning_varuna.comparing import GlobalBatches
from lightning_varuna.data.microbatch import batch_size_of, split_microbatches

pytest.importorskip("transformers", reason="the real-model tests train Hugging Face models: pip install transformers")
from real_models import ROWS, build  # noqa: E402

pytestmark = pytest.mark.slow  # real multi-process jobs

RUNNER = os.path.join(os.path.dirname(__file__), "run_real_models.py")
STEPS = 3

# (P, D, schedule) -> the models trained at that shape: each model at two shapes. Varuna's schedule recomputes
# forwards, which must leave BatchNorm's running statistics alone.
SHAPES = {
    (2, 1, "1f1b"): ["bn_mlp", "resnet", "bert", "gpt2", "demo_transformer", "causal_encoder", "vit"],
    (2, 2, "1f1b"): ["bn_mlp", "bert", "demo_transformer", "llama", "mixtral"],
    (1, 2, "1f1b"): ["resnet", "causal_encoder", "vit"],
    (3, 1, "1f1b"): ["gpt2", "t5"],
    (2, 1, "varuna"): ["bn_mlp", "resnet"],
    (2, 1, "zero-bubble"): ["gpt2", "t5"],
    (2, 1, "interleaved-1f1b"): ["gpt2", "demo_transformer"],  # two stages per rank (`STAGES_PER_RANK`)
    (2, 1, "zbv"): ["gpt2", "causal_encoder", "llama", "mixtral"],  # in a V: the tied embedding and head on one rank
}
STAGES_PER_RANK = {"interleaved-1f1b": 2, "zbv": 2}
BATCH, MICRO_BATCH = 4, 2  # per replica: micro-batches [2, 2]


def reference(
    name: str,
    data_parallel_size: int,
    precision: str = "32-true",
    steps: int = STEPS,
    callbacks: tuple[L.Callback, ...] = (),
    ckpt_path: Path | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], set[str]]:
    """One device, the same global batches, each run as the pipeline's micro-batches (loss weighted by rows);
    resumed from ``ckpt_path`` with the sampler Lightning gives one replica, which it sets to each epoch.

    Returns the logged losses, the final state dict and the names of the buffers.
    """
    model, data = build(name)
    step_loss = model.step_loss

    def microbatched(batch, batch_idx):  # noqa: ANN001, ANN202
        rows = batch_size_of(batch)
        parts = split_microbatches(batch, MICRO_BATCH)
        loss = sum(step_loss(part) * (batch_size_of(part) / rows) for part in parts)
        model.log("train_loss", loss, sync_dist=True)
        return loss

    model.training_step = microbatched
    record = RecordLosses()
    if ckpt_path is None:
        loader = DataLoader(
            data, batch_sampler=GlobalBatches(ROWS, batch_size=BATCH, data_parallel_size=data_parallel_size, seed=0)
        )
    else:
        loader = DataLoader(data, BATCH, sampler=DistributedSampler(range(ROWS), 1, 0, shuffle=True, seed=0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        precision=precision,
        callbacks=[record, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return record.losses, state, {name for name, _ in model.named_buffers()}


@pytest.mark.parametrize("shape", list(SHAPES), ids=[f"P{p}xD{d}-{schedule}" for p, d, schedule in SHAPES])
def test_real_models_train_like_one_device(tmp_path, shape):
    pp, dp, schedule = shape
    train(tmp_path, SHAPES[shape], pp, dp, schedule=schedule, stages_per_rank=STAGES_PER_RANK.get(schedule, 1))
    for name in SHAPES[shape]:
        assert_trained_like_one_device(tmp_path / name, name, pp, dp)


def test_real_models_resume_a_mid_epoch_checkpoint_at_another_pipeline_depth(tmp_path):
    """BatchNorm models (an MLP, Hugging Face ResNet) and GPT-2: a checkpoint written at step 2 of 3 at two stages
    resumes at three, and the run ends as one device's."""
    models = ["bn_mlp", "resnet", "gpt2"]
    train(tmp_path / "first", models, 2, 1, steps=STEPS - 1, save_every=STEPS - 1)
    train(tmp_path / "resumed", models, 3, 1, resume_from=str(tmp_path / "first"))
    for name in models:
        assert_trained_like_one_device(tmp_path / "resumed" / name, name, 3, 1, first_step=STEPS - 1)


class SaveAtFitEnd(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def test_a_run_begun_on_one_device_continues_pipelined_from_its_checkpoint(tmp_path):
    """The single-file checkpoint of a plain fit (``strategy="auto"``) of one epoch continues at two stages as on one
    device: the BatchNorm MLP and GPT-2, SGD's momentum read by parameter name."""
    models, epoch = ["bn_mlp", "gpt2"], ROWS // BATCH
    for name in models:
        reference(name, 1, steps=epoch, callbacks=(SaveAtFitEnd(tmp_path / "one_device" / name / "last.ckpt"),))
    train(tmp_path / "resumed", models, 2, 1, steps=epoch + 2, resume_from=str(tmp_path / "one_device"))
    for name in models:
        resumed = reference(name, 1, steps=epoch + 2, ckpt_path=tmp_path / "one_device" / name / "last.ckpt")
        assert len(resumed[0]) == 2
        assert_trained_like_one_device(tmp_path / "resumed" / name, name, 2, 1, expected=resumed)


def test_a_model_in_double_precision_trains_pipelined_like_one_device(tmp_path):
    """``precision="64-true"``: the model's parameters, its float batches and the tensors its forward makes (Lightning's
    demo Transformer makes its positional encoding) are doubles, from the start-up trace on, in the recomputes of
    Varuna's schedule too."""
    train(tmp_path, ["bn_mlp", "demo_transformer"], 2, 1, precision="64-true", schedule="varuna")
    for name in ("bn_mlp", "demo_transformer"):
        assert_trained_like_one_device(tmp_path / name, name, 2, 1, precision="64-true")
    assert torch.load(tmp_path / "bn_mlp" / "rank1.pt")["inp.weight"].dtype == torch.float64  # the first stage


def train(out_dir: Path, models: list[str], pp: int, dp: int, steps: int = STEPS, **config: object) -> None:
    """Train ``models`` with VarunaStrategy at ``pp`` x ``dp`` in a real multi-process job (`run_real_models`)."""
    config = dict(
        config,
        models=models,
        pipeline_parallel_size=pp,
        batch_size=BATCH,
        micro_batch_size=MICRO_BATCH,
        steps=steps,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = run_ranks([RUNNER, str(out_dir), json.dumps(config)], pp * dp, out_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def assert_trained_like_one_device(
    folder: Path,
    name: str,
    pp: int,
    dp: int,
    first_step: int = 0,
    precision: str = "32-true",
    expected: tuple[list[float], dict[str, torch.Tensor], set[str]] | None = None,
) -> None:
    """The losses logged from ``first_step`` on and every rank's final parameters and buffers equal the reference's
    (``expected``, if given)."""
    result = json.loads((folder / "losses.json").read_text())
    assert result["shape"] == [pp, dp]
    losses, weights, buffer_names = expected or reference(name, dp, precision)
    assert len(result["losses"]) == len(losses) - first_step
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses[first_step:]), rtol=1e-4, atol=1e-5)
    seen = set()
    shards = [torch.load(folder / f"rank{rank}.pt") for rank in range(pp * dp)]
    for rank, shard in enumerate(shards):
        first_replica = shards[rank % pp]  # the same stage in replica 0
        for key, value in shard.items():
            # Buffers (BatchNorm's running statistics) are replica 0's on every replica, as under DDP: with one
            # replica they are the single device's.
            expected = weights[key] if dp == 1 or key not in buffer_names else first_replica[key]
            where = f"{name}: {key} on rank {rank}"
            if value.is_floating_point():
                torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: w + m)
            else:
                assert torch.equal(value, expected), where
            seen.add(key)
    assert seen == set(weights), f"{name}: no rank holds {sorted(set(weights) - seen)}"
