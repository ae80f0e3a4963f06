"""VarunaStrategy on one CUDA GPU: one stage, one replica, in this process. NCCL, the stage's module, micro-batches and
gradients on the GPU, CUDA loss scaling and checkpoints of GPU tensors: it trains as plain Lightning on that GPU.

Skipped without a GPU (CI has none). Two stages or replicas need a GPU each: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from models import RecordLosses, TinyLM, token_dataset
from torch.utils.data import DataLoader, DistributedSampler

from lightning_varuna import VarunaStrategy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def exact_and_alone() -> Any:
    """fp32 matmuls without TF32; an NCCL group of this test's own (a fit leaves its group for the next fit)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def fit_on_the_gpu(
    model: TinyLM,
    strategy: Any,
    max_steps: int,
    callbacks: Sequence[L.Callback] = (),
    ckpt_path: str | None = None,
    plugins: Sequence[Any] = (),
) -> tuple[L.Trainer, RecordLosses]:
    record = RecordLosses()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        plugins=list(plugins),
        callbacks=[record, *callbacks],
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = token_dataset(48)
    # Plain Lightning reads the data in the order Lightning's sampler gives a distributed strategy (comparing.md).
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if strategy == "auto" else None
    trainer.fit(model, DataLoader(data, batch_size=6, sampler=sampler), ckpt_path=ckpt_path)
    return trainer, record


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module, **tolerance: float) -> None:
    reference_state = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), reference_state[name].cpu(), msg=name, **tolerance)


@pytest.mark.parametrize("schedule", ["1f1b", "varuna"])
def test_one_stage_on_the_gpu_trains_as_plain_lightning(tmp_path, schedule):
    """Micro-batches of 2 rows (3 a batch) on the GPU; the fit is stopped after 3 steps and resumed from its
    checkpoint: the losses and weights equal plain Lightning's 6 steps on the GPU."""
    torch.manual_seed(0)
    reference = TinyLM(scheduler=True)
    model = copy.deepcopy(reference)
    _, expected = fit_on_the_gpu(reference, "auto", max_steps=6)

    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    strategy = VarunaStrategy(micro_batch_size=2, schedule=schedule)
    trainer, first = fit_on_the_gpu(model, strategy, max_steps=3, callbacks=[every_step])
    assert trainer.strategy.root_device.type == "cuda" and dist.get_backend() == "nccl"
    assert trainer.strategy.lightning_module is model
    resumed = TinyLM(scheduler=True)
    dist.destroy_process_group()  # as in a new process
    strategy = VarunaStrategy(micro_batch_size=2, schedule=schedule)
    _, second = fit_on_the_gpu(resumed, strategy, max_steps=6, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))

    torch.testing.assert_close(first.losses + second.losses, expected.losses, rtol=1e-5, atol=1e-6)
    assert_same_weights(resumed, reference, rtol=1e-5, atol=1e-6)


def test_fp16_loss_scaling_on_the_gpu_skips_the_steps_plain_lightning_skips():
    """``16-mixed`` with CUDA's GradScaler, whose first scales overflow the gradients: the pipelined run skips the
    same steps and backs off the scale as plain Lightning does, and its losses are equal within fp16's rounding
    (which differs on micro-batches)."""
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    _, expected = fit_on_the_gpu(reference, "auto", max_steps=8, plugins=[fp16_with_scale(2.0**24)])
    strategy = VarunaStrategy(micro_batch_size=3)
    _, pipelined = fit_on_the_gpu(model, strategy, max_steps=8, plugins=[fp16_with_scale(2.0**24)])

    assert expected.loss_scales[-1] < 2.0**24 / 8  # several steps overflowed and were skipped
    assert pipelined.loss_scales == expected.loss_scales
    torch.testing.assert_close(pipelined.losses, expected.losses, rtol=1e-2, atol=1e-2)
    assert_same_weights(model, reference, rtol=1e-2, atol=1e-3)


def fp16_with_scale(init_scale: float) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cuda", torch.amp.GradScaler("cuda", init_scale=init_scale))
