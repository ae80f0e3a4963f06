"""The pipeline's engine without a Trainer: a stage's runtime, the step engine, the sums over replicas and tied
weights, and clipping by the norm over all stages, in real gloo jobs (tests/run_engine.py), against one process."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import run_job
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from models import TinyLM
from run_engine import batch

RUNNER = os.path.join(os.path.dirname(__file__), "run_engine.py")
CLIP = 0.05  # below the gradients' norm, so clipping changes them


def reference() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One process, the whole batch at once: the loss, the clipped gradients by name, the norm before clipping."""
    torch.manual_seed(0)
    model = TinyLM()
    idx, y = batch()
    loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, norm


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "pp", "dp", "schedule", "boundaries"),
    [
        ("runtime", 2, 1, "gpipe", ["cuts.2"]),
        ("runtime", 4, 1, "1f1b", ["cuts.0", "cuts.1", "cuts.3"]),
        ("step", 2, 2, "1f1b", ["cuts.1"]),
        ("step", 3, 1, "varuna", ["cuts.1", "cuts.2"]),
    ],
)
def test_pipelined_gradients_equal_one_process(tmp_path, engine, pp, dp, schedule, boundaries):
    config = {"engine": engine, "pp": pp, "schedule": schedule, "boundaries": boundaries, "clip": CLIP}
    launch = ["-m", "torch.distributed.run", f"--nproc-per-node={pp * dp}", f"--master-port={find_free_network_port()}"]
    proc = run_job([*launch, RUNNER, str(tmp_path), json.dumps(config)], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    loss, grads, norm = reference()
    seen = set()
    for rank in range(pp * dp):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(result["norm"], norm, msg=lambda m, r=rank: f"norm on rank {r}: {m}")
        assert result["grads"], f"rank {rank} holds no parameters"
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            seen.add(name)
        if result["pp_rank"] == pp - 1 and dp == 1:
            torch.testing.assert_close(result["loss"], loss)
    assert seen == set(grads), f"no rank holds {sorted(set(grads) - seen)}"
