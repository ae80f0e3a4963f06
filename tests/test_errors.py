"""Bad input fails before training with a message that says what to change."""

from __future__ import annotations

import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import run_job
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.loggers import TensorBoardLogger
from models import SEQ, NormalizesOverRows, TinyLM, token_dataset
from torch.utils.data import DataLoader

from lightning_varuna import SpillingStrategy, VarunaStrategy
from lightning_varuna.strategies.process_groups import choose_backend

# A budget that cuts TinyLM into 5 shards at batches of 6 (it needs 84 KB whole).
CUT = "65KB"


def fit(
    model: L.LightningModule,
    strategy: L.pytorch.strategies.Strategy,
    batch_size: int = 6,
    callbacks: list[L.Callback] | None = None,
) -> None:
    trainer = L.Trainer(
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(token_dataset(12), batch_size=batch_size))


class CutPointTwice(TinyLM):
    def forward(self, idx):
        return self.head(self.cuts[0](self.cuts[0](self.emb(idx))))


class TupleAtCutPoint(TinyLM):
    def forward(self, idx):
        x = self.emb(idx)
        return self.head(self.cuts[0]((x, x))[0])


class TransposedAtCutPoint(TinyLM):
    def forward(self, idx):
        return self.head(self.cuts[0](self.emb(idx).transpose(0, 1)).transpose(0, 1))


class DataDependentBranch(TinyLM):
    def forward(self, idx):
        x = self.cuts[0](self.emb(idx))
        if x.sum() > 0:  # python control flow on a tensor value: not traceable
            x = x * 2
        return self.head(x)


class BranchOnTheStep(TinyLM):
    def forward(self, idx):
        if self.global_step >= 3:  # a curriculum: traced once at step 0, this branch would never be taken
            idx = idx.flip(1)
        return super().forward(idx)


class ScaledByTheWorld(TinyLM):
    def forward(self, idx):
        # Fixed for the whole fit: right at every step once traced.
        scale = 1.0 if self.trainer.precision == "32-true" else 0.5
        return super().forward(idx) * scale / self.trainer.world_size**self.trainer.num_nodes


@pytest.mark.parametrize(
    "cutting",
    [lambda: VarunaStrategy(micro_batch_size=4), lambda: SpillingStrategy(memory_budget=CUT)],
    ids=["varuna", "spilled"],
)
def test_a_forward_reading_the_trainer_is_refused_when_cut(cutting):
    """A cut model runs the operations traced at set-up: a branch on the Trainer's state would keep its first way.
    (A model that fits in one shard runs its own forward, and reads it every step.)"""
    with pytest.raises(
        TypeError, match=r"reads the Trainer's `global_step` at line \d+ of .*test_errors.py \(`if self"
    ):
        fit(BranchOnTheStep(), cutting())
    fit(BranchOnTheStep(), SpillingStrategy(memory_budget="1GB"))
    fit(ScaledByTheWorld(), cutting())  # reads only what a fit never changes (sizes, precision)


class SpectralNormLM(TinyLM):
    """A parametrization whose power iteration runs under `no_grad`: a grad-mode block in a submodule, which torch's
    split dropped from the stage without an error (it failed at the first step with missing inputs)."""

    def __init__(self):
        super().__init__()
        torch.nn.utils.parametrizations.spectral_norm(self.blocks[2].fc)


class CallsASubmodule(TinyLM):
    """Runs its layers directly, as a step wrapping a torchvision model (`self.net(x)`) does; `example_input_array`
    set, which does not make such a step cut."""

    def __init__(self):
        super().__init__()
        self.example_input_array = torch.zeros(2, 6, dtype=torch.long)

    def training_step(self, batch, batch_idx):
        keep = (batch[0] != 0).unsqueeze(-1).float()
        x = self.emb(batch[0])
        for block in self.blocks:
            x = block(x, keep)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())


class UnregisteredParameter(TinyLM):
    """Its optimizer trains a parameter the module does not hold: checkpoints keep optimizer state by name."""

    def configure_optimizers(self):
        self.temperature = [torch.nn.Parameter(torch.ones(()))]  # a list is not registered
        return torch.optim.AdamW([*self.parameters(), *self.temperature])


@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        (CutPointTwice(), ValueError, r"CutPoint `cuts.0` was called twice"),
        (TupleAtCutPoint(), TypeError, r"CutPoint `cuts.0` got a value of type `tuple`"),
        (TransposedAtCutPoint(), ValueError, r"shape \(6, 4, 16\), but the batch the forward was run with has 4 rows"),
        (DataDependentBranch(), RuntimeError, r"Cannot cut `DataDependentBranch.forward` into pipeline stages"),
        (SpectralNormLM(), RuntimeError, r"changes the grad mode inside .*`spectral_norm`.* calls `blocks.2` without"),
        (CallsASubmodule(), RuntimeError, r"never called `self\(...\)`.*a submodule called directly"),
        (UnregisteredParameter(), ValueError, r"shape \(\) that is not a parameter of `UnregisteredParameter`"),
    ],
)
def test_bad_model_fails_at_setup(model, error, match):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        fit(model, VarunaStrategy(micro_batch_size=4))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_optimizer_over_a_parameter_the_module_does_not_hold_fails_at_spilled_setup():
    """Spilled, such a parameter would never step (the optimizer steps each shard's parameters): refused at set-up."""
    model = UnregisteredParameter()
    with pytest.raises(ValueError, match=r"shape \(\) that is not a parameter of `UnregisteredParameter`"):
        fit(model, SpillingStrategy(memory_budget=CUT))
    assert model.trainer.global_step == 0


def test_a_cutpoint_used_twice_is_named_once_when_spilled():
    with pytest.raises(ValueError, match=r"CutPoint `cuts.0` was called twice") as refused:
        fit(CutPointTwice(), SpillingStrategy(memory_budget=CUT))
    assert refused.value.__context__ is None  # not the same error again, raised while handling the first


def test_a_one_row_micro_batch_through_batch_norm_names_the_layer_and_the_fix():
    model = NormalizesOverRows()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"`norm` \(BatchNorm1d\) got an input of shape \(1, 16\).*micro_batch_size=2"):
        fit(model, VarunaStrategy(micro_batch_size=1))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    fit(model, VarunaStrategy(micro_batch_size=2))
    assert model.trainer.global_step == 1


def test_micro_batch_larger_than_batch():
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"micro_batch_size=8\)` is larger than the batch of 6 rows"):
        fit(model, VarunaStrategy(micro_batch_size=8), batch_size=6)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(schedule="zigzag"),
            r"schedule='zigzag'\)` is unknown; choose one of "
            r"\['1f1b', 'gpipe', 'interleaved-1f1b', 'varuna', 'zbv', 'zero-bubble'\]",
        ),
        (dict(pipeline_parallel_size=0), r"pipeline_parallel_size=0\)` must be a positive integer"),
        (dict(micro_batch_size=-1), r"micro_batch_size=-1\)` must be a positive integer"),
        (dict(loss_items="labels"), r"loss_items='labels'\)` must be a function of a batch"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VarunaStrategy(**kwargs)


@pytest.mark.parametrize(
    ("devices", "kwargs", "match"),
    [
        (3, dict(pipeline_parallel_size=2), r"The world size 3 is not a multiple of `pipeline_parallel_size=2`"),
        (2, dict(pipeline_parallel_size=2, data_parallel_size=2), r"world size 2 is not .* 2 x 2. Launch 4 processes"),
        (2, dict(global_batch_size=5), r"global_batch_size=5\)` does not split evenly over data_parallel_size=2"),
    ],
)
def test_a_world_the_sizes_do_not_fit_is_refused_before_any_process_starts(devices, kwargs, match):
    """The Trainer refuses it as it is made (each process started refused it, after the wait for them to start)."""
    with pytest.raises(ValueError, match=match):
        L.Trainer(accelerator="cpu", devices=devices, strategy=VarunaStrategy(**kwargs), logger=False)


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
from torch.utils.data import DataLoader
from models import TinyLM, token_dataset
from lightning_varuna import VarunaStrategy
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.loggers import TensorBoardLogger
trainer = L.Trainer(accelerator="cpu", devices={devices}, strategy=VarunaStrategy({strategy}), callbacks={callbacks},
                    max_steps=1, logger={logger}, enable_checkpointing=False, enable_progress_bar=False)
model = TinyLM(blocks={blocks})
if {graph}:
    model.example_input_array = torch.zeros(2, 6, dtype=torch.long)
trainer.fit(model, DataLoader(token_dataset(8), batch_size=4))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "strategy", "blocks", "match"),
    [
        (
            2,
            "pipeline_parallel_size=2",
            1,
            r"pipeline_parallel_size=2\)` needs at least 1 CutPoint\(s\) in the forward, but `TinyLM` calls 0",
        ),
        (
            2,
            "pipeline_parallel_size=2, schedule='interleaved-1f1b', stages_per_rank=3",
            5,
            r"stages_per_rank=3\)` cuts 6 stages and needs at least 5 CutPoint\(s\) in the forward, but `TinyLM` "
            r"calls 4",
        ),
        (
            2,
            "pipeline_parallel_size=2",
            5,
            r"`EMAWeightAveraging` keeps an average of every parameter of the model, but with 2 pipeline stages",
        ),
        (
            2,
            "pipeline_parallel_size=2",
            5,
            r"`TensorBoardLogger\(log_graph=True\)` draws .*, but with 2 pipeline stages each process holds its stage",
        ),
    ],
)
def test_bad_layout_fails_in_every_process(tmp_path, devices, strategy, blocks, match):
    script = tmp_path / "job.py"
    tests = str(__import__("pathlib").Path(__file__).parent)
    callbacks = "[EMAWeightAveraging()]" if "EMA" in match else "[]"
    graph = "TensorBoardLogger" in match  # a logger that draws the graph of the model and its example input
    if graph:
        pytest.importorskip("tensorboard", reason="TensorBoardLogger draws graphs with tensorboard")
    logger = f"TensorBoardLogger({str(tmp_path)!r}, log_graph=True)" if graph else "False"
    text = SCRIPT.format(
        tests=tests, devices=devices, strategy=strategy, blocks=blocks, callbacks=callbacks, logger=logger, graph=graph
    )
    script.write_text(textwrap.dedent(text))
    proc = run_job([str(script)], tmp_path, timeout=300)
    assert proc.returncode != 0
    assert __import__("re").search(match, proc.stderr), proc.stderr[-3000:]


ITERABLE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset
from models import TinyLM, token_dataset
from lightning_varuna import VarunaStrategy


class Split(IterableDataset):
    def __iter__(self):
        rank, count = {split}
        data = token_dataset(16)
        return (data[i] for i in range(rank, len(data), count))


strategy = VarunaStrategy(pipeline_parallel_size=2)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(TinyLM(), DataLoader(Split(), batch_size=4))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "split",
    [
        "dist.get_rank(), dist.get_world_size()",  # as under DDP: each stage gets batches of its own
        "strategy.topology.dp_rank, strategy.topology.data_parallel_size",
    ],
    ids=["by-global-rank", "by-data-parallel-rank"],
)
def test_the_stages_of_a_replica_must_read_one_batch(tmp_path, split):
    script = tmp_path / "job.py"
    tests = str(Path(__file__).parent)
    script.write_text(textwrap.dedent(ITERABLE_SCRIPT.format(tests=tests, split=split)))
    proc = run_job([str(script)], tmp_path, timeout=300)
    if split.startswith("dist"):
        assert proc.returncode != 0
        assert "The pipeline stages of one replica read different batches" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]


class ManualOptimization(TinyLM):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize("strategy", [VarunaStrategy, SpillingStrategy])
def test_manual_optimization_fails_at_setup(strategy):
    """Both strategies run the step's forward and backward themselves (under SpillingStrategy the manual steps
    trained nothing: the weights stayed as they were)."""
    with pytest.raises(TypeError, match=rf"automatic_optimization = False`: {strategy.__name__}.*needs Lightning.s"):
        fit(ManualOptimization(), strategy())


def test_pruning_as_it_trains_is_refused():
    """`ModelPruning` applies its masks through hooks it adds as the model trains, which the traced forward does not
    run: with one stage it trained the unpruned weights without a word, with two it failed in the callback."""
    with pytest.raises(ValueError, match=r"`ModelPruning` prunes the model as it trains.* VarunaStrategy runs the"):
        fit(TinyLM(), VarunaStrategy(micro_batch_size=4), callbacks=[ModelPruning("l1_unstructured")])


def test_a_graph_of_a_spilled_model_is_refused(tmp_path):
    """TensorBoard draws a model's graph by running the whole model on its ``example_input_array`` after set-up,
    which failed on the spilled model, deep in the trace; a model that runs whole draws it."""
    pytest.importorskip("tensorboard", reason="TensorBoardLogger draws graphs with tensorboard")
    spilled, whole = TinyLM(), TinyLM()
    for model in spilled, whole:
        model.example_input_array = torch.zeros(2, SEQ, dtype=torch.long)
    for model, budget in (spilled, "85KB"), (whole, "10MB"):
        logger = TensorBoardLogger(tmp_path, log_graph=True)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=SpillingStrategy(memory_budget=budget), max_steps=1,
                            logger=logger, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
        if model is spilled:
            with pytest.raises(ValueError, match=r"log_graph=True\)` draws .* keeps the model spilled in 5 shard\(s\)"):
                trainer.fit(model, DataLoader(token_dataset(16), batch_size=8))
        else:
            trainer.fit(model, DataLoader(token_dataset(16), batch_size=8))
            assert trainer.global_step == 1


def test_ranks_sharing_a_gpu_talk_over_gloo_and_nccl_is_refused_for_them():
    """NCCL refuses two ranks on one GPU: processes that share one default to gloo, and asking for NCCL says what to
    change before any process group starts."""
    gpu, other = torch.device("cuda", 0), torch.device("cuda", 1)
    assert choose_backend(None, [gpu, gpu], gpu) == "gloo"
    assert choose_backend(None, [gpu, other], gpu) == "nccl"
    assert choose_backend(None, [gpu, gpu, other], other) == "gloo"  # every rank of the job alike
    assert choose_backend(None, [torch.device("cpu")] * 2, torch.device("cpu")) == "gloo"
    assert choose_backend("gloo", [gpu, other], gpu) == "gloo"
    with pytest.raises(ValueError, match=r"share cuda:0 .* NCCL refuses two ranks on one GPU: leave"):
        choose_backend("nccl", [gpu, gpu], gpu)
    with pytest.raises(ValueError, match="NCCL refuses"):
        choose_backend("cpu:gloo,cuda:nccl", [gpu, gpu, other], other)
