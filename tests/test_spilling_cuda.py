"""SpillingStrategy on a CUDA GPU: exact training, device memory within the budget, copies overlapping compute.

Skipped without a GPU (the CUDA path has not run yet: these are its checks for a machine that has one).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from models import TinyLM
from spilled_runs import BUDGETS, LAYERS, WIDTH, LossScales, assert_same_model, fit, fit_mlp, losses

from lightning_varuna import SpillingStrategy
from lightning_varuna.demos import MLP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def exact_matmuls() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("disk", [False, True], ids=["pinned-host", "disk"])
def test_trains_like_one_gpu(tmp_path, disk):
    torch.manual_seed(0)
    reference = TinyLM(dropout=0.1, scheduler=True)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit(reference, "auto", accelerator="gpu")
    torch.manual_seed(1)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=tmp_path if disk else None)
    trainer = fit(model, strategy, accelerator="gpu")
    assert len(strategy.shards) == 5
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model.cpu(), reference.cpu())


@pytest.mark.parametrize("disk", [False, True], ids=["pinned-host", "disk"])
def test_fp16_skips_the_steps_one_gpu_skips(tmp_path, disk):
    """``16-mixed`` with CUDA's grad scaler, whose first scales overflow the gradients: the spilled run skips the same
    steps and backs off the scale as one GPU does, with its losses and weights."""

    def fp16_overflowing() -> MixedPrecision:
        return MixedPrecision("16-mixed", "cuda", torch.amp.GradScaler("cuda", init_scale=2.0**24))

    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    expected_scales, scales = LossScales(), LossScales()
    options: dict[str, Any] = dict(accelerator="gpu", max_steps=8)
    expected = fit(reference, "auto", plugins=[fp16_overflowing()], callbacks=[expected_scales], **options)
    strategy = SpillingStrategy(memory_budget=BUDGETS[5], spill_dir=tmp_path if disk else None)
    trainer = fit(model, strategy, plugins=[fp16_overflowing()], callbacks=[scales], **options)
    assert len(strategy.shards) == 5
    assert expected_scales.scales[-1] < 2.0**24 / 4  # overflowing steps were skipped
    assert scales.scales == expected_scales.scales
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model.cpu(), reference.cpu())


class WhereTheWeightsAre(L.Callback):
    """The devices of the model's parameters, and whether they hold elements, after each training batch."""

    def __init__(self) -> None:
        self.seen: list[set[tuple[str, bool]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.seen.append({(p.device.type, p.numel() > 0) for p in pl_module.parameters()})


def test_a_model_that_fits_stays_on_the_gpu():
    """A model that fits its budget in one shard is not spilled: between steps its parameters are on the GPU, and
    it trains like one GPU."""
    torch.manual_seed(0)
    reference = TinyLM(dropout=0.1)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit(reference, "auto", accelerator="gpu")
    torch.manual_seed(1)
    where = WhereTheWeightsAre()
    strategy = SpillingStrategy(memory_budget=BUDGETS[1])
    trainer = fit(model, strategy, accelerator="gpu", callbacks=[where])
    assert len(strategy.shards) == 1
    assert where.seen == [{("cuda", True)}] * 8
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model.cpu(), reference.cpu())


class DeviceMemory(L.Callback):
    """The most device memory allocated over steps 2.., beside what was allocated after step 1 (when every shard is
    spilled: cuBLAS's workspaces, 32 MiB per thread that multiplies matrices on Hopper GPUs)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            torch.cuda.synchronize()
            self.start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = torch.cuda.max_memory_allocated()


def test_device_memory_stays_within_the_budget():
    """A model with 8x the budget of state: during a step the device holds at most the budget (plus 8 MiB of slack)
    beyond what it held between steps."""
    torch.manual_seed(0)
    model, budget = MLP(WIDTH, LAYERS), 12 * 2**20
    assert sum(4 * p.numel() * p.element_size() for p in model.parameters()) >= 8 * budget
    memory = DeviceMemory()
    trainer = fit_mlp(model, SpillingStrategy(memory_budget=budget), max_steps=4, callbacks=[memory], accelerator="gpu")
    assert len(trainer.strategy.shards) == LAYERS  # type: ignore[attr-defined]
    held = memory.peak - memory.start
    assert held <= budget + 8 * 2**20, f"{held / 2**20:.1f} MiB held during a step for a budget of 12 MiB"


class ProfileStep(L.Callback):
    """A torch.profiler trace of training step 3, written to ``path`` (open it in Perfetto)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            self.profiler.start()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            torch.cuda.synchronize()
            self.profiler.stop()
            self.profiler.export_chrome_trace(self.path)


def test_copies_to_the_device_overlap_compute(tmp_path):
    """In a step's trace, copies from pinned host memory run on a stream of their own while kernels run (batches
    large enough that a shard computes longer than the host takes to issue its work: at 8192 rows an H200 was idle
    two thirds of the step, and a copy overlapped a kernel only in some runs)."""
    torch.manual_seed(0)
    path = str(tmp_path / "step.json")
    strategy = SpillingStrategy(memory_budget="3.5GiB")  # 2.9 GiB of activations at the CutPoints, 12 shards
    fit_mlp(
        MLP(WIDTH, LAYERS),
        strategy,
        max_steps=4,
        rows=4 * 32768,
        batch_size=32768,
        callbacks=[ProfileStep(path)],
        accelerator="gpu",
    )
    assert len(strategy.shards) > 1
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies_in = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    assert kernels and copies_in
    kernel_streams = {e["args"]["stream"] for e in kernels}
    own_stream = [e for e in copies_in if e["args"]["stream"] not in kernel_streams]
    assert own_stream, "copies to the device run on the compute stream"
    overlapping = [
        c for c in own_stream for k in kernels if c["ts"] < k["ts"] + k["dur"] and k["ts"] < c["ts"] + c["dur"]
    ]
    assert overlapping, "no copy to the device overlaps a kernel"
