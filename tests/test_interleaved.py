"""The interleaved 1F1B schedule (several stages per rank, round-robin) trains the same model as one device (real
processes, gloo), and what it cannot run is refused before training."""

from __future__ import annotations

import pytest
from test_parity import assert_matches_single_device, run_pipelined

from lightning_varuna import VarunaStrategy

pytestmark = pytest.mark.slow  # real multi-process jobs

INTERLEAVED = dict(schedule="interleaved-1f1b", epochs=2)

SHAPES = {
    # 4 stages on 2 ranks (the tied embedding on rank 1's stage 0, the head on rank 0's stage 3, and the mask stage 0
    # makes read by every stage, so stage 0 sends it to stage 2 on its own rank); micro-batches [2, 2, 2], clipping by
    # the global norm, validation and predictions (forwards only, every stage of a rank in turn)
    "P2xD1-V2-clip": dict(
        pipeline_parallel_size=2, data_parallel_size=1, batch_size=6, micro_batch_size=2, clip=0.05, evaluate=True
    ),
    # replicas and gradient accumulation; micro-batches [1] * 4 in torch's rounds of 2
    "P2xD2-V2-accumulate": dict(
        pipeline_parallel_size=2, data_parallel_size=2, batch_size=4, micro_batch_size=1, accumulate=2, clip=0.05
    ),
    # 6 stages on 2 ranks (6 blocks, 5 CutPoints); micro-batches [2, 2, 1]
    "P2xD1-V3": dict(
        pipeline_parallel_size=2, data_parallel_size=1, batch_size=5, micro_batch_size=2, stages_per_rank=3, blocks=6
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_interleaved_training_matches_single_device(tmp_path, name):
    config = {**INTERLEAVED, **SHAPES[name]}
    config["rows"] = config["batch_size"] * config["data_parallel_size"] * 3
    result, shards = run_pipelined(tmp_path, config)
    assert result["schedule"] == "interleaved-1f1b"
    assert_matches_single_device(result, shards, config)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(schedule="varuna", stages_per_rank=2), r"stages_per_rank=2\)` needs an interleaved schedule"),
        (dict(schedule="interleaved-1f1b", stages_per_rank=1), r"interleaves 2 or more stages per rank"),
        (dict(schedule="interleaved-1f1b", pipeline_parallel_size=1), r"with `pipeline_parallel_size=1`"),
        (
            dict(schedule="interleaved-1f1b", pipeline_parallel_size=2, micro_batch_size="auto", profile="p.json"),
            r"cannot be combined with micro_batch_size=auto",
        ),
    ],
)
def test_what_interleaving_cannot_run_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        VarunaStrategy(**{"pipeline_parallel_size": 2, "global_batch_size": 8, **options})
