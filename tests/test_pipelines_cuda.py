"""VarunaStrategy's pipelines on one CUDA GPU: 2 or 4 processes share it (``Trainer(accelerator="gpu", devices=1)``,
the strategy's ``parallel_devices`` the GPU once per rank) over gloo, since NCCL refuses two ranks on one GPU; the
stages' messages go through pinned host buffers. Every schedule trains as plain Lightning on that GPU (fp32: losses,
metrics, predictions and weights), fp16 with CUDA's GradScaler skips the same steps, bf16 tracks it.

Skipped without a GPU (CI has none).
"""

from __future__ import annotations

import pytest
import torch
from test_interleaved import SHAPES as INTERLEAVED_SHAPES
from test_parity import (
    BF16,
    FP16,
    assert_matches_single_device,
    bf16_tracks_single_device,
    fp16_skips_like_single_device,
    run_pipelined,
)
from test_parity import SHAPES as PARITY_SHAPES
from test_zbv import SHAPES as ZBV_SHAPES

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ON_THE_GPU = dict(accelerator="gpu", epochs=2)

SHAPES = {
    **{name: PARITY_SHAPES[name] for name in ("P2xD1-1f1b-clip", "P2xD2-1f1b-scheduler", "P4xD1-varuna")},
    "P4xD1-zero-bubble": PARITY_SHAPES["P4xD1-zero-bubble"],
    "P3xD1-gpipe-uneven": PARITY_SHAPES["P3xD1-gpipe-uneven"],
    "P2xD1-interleaved-1f1b-clip": dict(INTERLEAVED_SHAPES["P2xD1-V2-clip"], schedule="interleaved-1f1b"),
    "P2xD1-zbv-clip": dict(ZBV_SHAPES["P2xD1-clip"], schedule="zbv"),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_pipelines_sharing_the_gpu_train_as_plain_lightning_on_it(tmp_path, name):
    config = {**SHAPES[name], **ON_THE_GPU}
    config.pop("trace", None)
    config["rows"] = config["batch_size"] * config["data_parallel_size"] * 3
    result, shards = run_pipelined(tmp_path, config)
    assert result["schedule"] == config["schedule"]
    assert result["device"] == "cuda:0"
    assert_matches_single_device(result, shards, config)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_fp16_on_the_gpu_skips_the_same_steps_as_plain_lightning(tmp_path, schedule):
    """CUDA's GradScaler: the first scales overflow, and every stage skips those steps with one GPU's Lightning."""
    config = dict(FP16, pipeline_parallel_size=2, data_parallel_size=1, rows=36, schedule=schedule, **ON_THE_GPU)
    fp16_skips_like_single_device(tmp_path, config)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_bf16_on_the_gpu_tracks_plain_lightning(tmp_path, schedule):
    bf16_tracks_single_device(tmp_path, dict(BF16, schedule=schedule, precision="bf16-mixed", accelerator="gpu"))
