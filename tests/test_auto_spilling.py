"""One entry point: ``VarunaStrategy(pipeline_parallel_size="auto", memory_budget=...)`` trains spilled where the
auto-configuration chose it (one process, a budget the model does not fit whole) and pipelined otherwise, from the
same script, and trains the same model as one device."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from models import RecordLosses, TinyLM, token_dataset
from reference import train_reference
from torch.utils.data import DataLoader

from lightning_varuna import SpillingStrategy, VarunaStrategy
from lightning_varuna.profiling.autoconfig import choose_configs
from lightning_varuna.profiling.profile import LinearCost, ModelProfile
from lightning_varuna.profiling.profiler import profile_model
from lightning_varuna.profiling.spilled import SpilledConfig, SpilledPrediction
from lightning_varuna.spilling.bandwidth import measure_spill_tiers

DIM, GLOBAL_BATCH, ROWS = 64, 6, 12
# Between what TinyLM(dim=64) needs spilled (shards fetched ahead: ~290 kB at 6 rows) and whole on one device
# (~385 kB at micro-batches of one row), above what the larger of two pipeline stages needs at any cut (~350 kB: the
# stages are balanced by measured time, which on so small a model may cut after the first block).
BUDGET = 360_000


def profile_with_spill_times(folder) -> ModelProfile:  # noqa: ANN001
    """A profile of TinyLM(dim=64), its spill tiers measured; the network's costs are set, not measured (they only
    rank pipeline shapes against each other)."""
    model = TinyLM(dim=DIM)
    profile = profile_model(model, (token_dataset(6).tensors[0],), micro_batch_sizes=[1, 6], thread_counts=[1],
                            repeats=1, progress=False)  # fmt: skip
    profile.spill = measure_spill_tiers(torch.device("cpu"), folder, sizes=(1 << 12, 1 << 16), repeats=1)
    profile.p2p = {n: LinearCost(1e-4, 1e9) for n in range(2, 5)}
    profile.allreduce = {n: {d: LinearCost(1e-4, 1e9) for d in range(2, 5)} for n in range(2, 5)}
    return profile


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> str:  # noqa: ANN001
    folder = tmp_path_factory.mktemp("profile")
    path = str(folder / "tinylm.json")
    profile_with_spill_times(folder).save(path)
    return path


def fit(strategy: VarunaStrategy, epochs: int = 1) -> tuple[L.Trainer, list[float], dict[str, torch.Tensor]]:
    L.seed_everything(0)
    model, record = TinyLM(dim=DIM), RecordLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=[record],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(token_dataset(ROWS), batch_size=1))
    return trainer, record.losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def auto(profile: str, budget: int | str | None, **kwargs) -> VarunaStrategy:  # noqa: ANN003
    return VarunaStrategy(
        pipeline_parallel_size="auto", micro_batch_size=1, global_batch_size=GLOBAL_BATCH, profile=profile,
        memory_budget=budget, **kwargs,
    )  # fmt: skip


def test_one_process_trains_spilled_within_the_budget_and_pipelined_without_it(profile_path, tmp_path, monkeypatch):
    """The same script: at a budget the model does not fit whole, spilled (several shards), otherwise as one
    pipeline stage; both train exactly as one device does on the same batches."""
    monkeypatch.chdir(tmp_path)
    reference, weights = train_reference(
        dict(pipeline_parallel_size=1, data_parallel_size=1, batch_size=GLOBAL_BATCH, rows=ROWS, epochs=2, dim=DIM,
             evaluate=True)
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"checkpoint_tempdir='local'\) is not used while the job trains spilled"):
        trainer, losses, trained = fit(auto(profile_path, BUDGET, checkpoint_tempdir="local"), epochs=2)
    strategy = trainer.strategy
    assert isinstance(strategy, SpillingStrategy) and len(strategy.shards) > 1
    assert isinstance(strategy.chosen, SpilledConfig) and strategy.chosen.tier == "host"
    assert strategy.budget_bytes == BUDGET
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    for name, value in trained.items():
        torch.testing.assert_close(value, weights[name], rtol=1e-4, atol=1e-6, msg=name)
    # The Trainer's later runs are spilled too: the model, whole again after fit, validates as on one device.
    [validated] = trainer.validate(trainer.lightning_module, DataLoader(token_dataset(ROWS, seed=2), batch_size=6))
    assert validated["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)

    # A budget the model fits whole: spilling is not a candidate (it would be one shard).
    trainer, losses, trained = fit(auto(profile_path, "64MB"), epochs=2)
    assert isinstance(trainer.strategy, VarunaStrategy) and trainer.strategy.pipeline_parallel_size == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)


def test_the_same_lightning_cli_config_trains_spilled_or_pipelined(profile_path, tmp_path):
    """``trainer.strategy`` as ``class_path``/``init_args`` in a YAML config; its budget overridden on the command
    line, the same config trains pipelined."""
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "auto.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: lightning_varuna.VarunaStrategy
    init_args:
      pipeline_parallel_size: auto
      micro_batch_size: 1
      global_batch_size: {GLOBAL_BATCH}
      profile: {profile_path}
      memory_budget: {BUDGET}
model:
  dim: {DIM}
"""
    )
    loader = DataLoader(token_dataset(ROWS), batch_size=1)
    for extra, spilled in (([], True), (["--trainer.strategy.init_args.memory_budget=64MB"], False)):
        cli = LightningCLI(TinyLM, run=False, args=["--config", str(config), *extra], save_config_callback=None)
        cli.trainer.fit(cli.model, loader)
        assert isinstance(cli.trainer.strategy, SpillingStrategy) is spilled
        assert cli.trainer.global_step == 2


def test_refusals_say_what_to_change(profile_path):
    with pytest.raises(ValueError, match='memory_budget=.*pass `pipeline_parallel_size="auto"`'):
        VarunaStrategy(pipeline_parallel_size=2, memory_budget="1GB")
    with pytest.raises(ValueError, match="spill_dir=.*needs a `memory_budget=`"):
        auto(profile_path, None, spill_dir="spill")
    profile = ModelProfile.load(profile_path)
    # On one process the budget trains it spilled; with the host tier unmeasured it cannot.
    [best, *_] = choose_configs(profile, 1, GLOBAL_BATCH, micro_batch_size=1, memory_bytes=BUDGET, spill_tiers=["host"])
    assert isinstance(best, SpilledPrediction) and best.config.memory_budget == BUDGET
    unmeasured = ModelProfile.load(profile_path)
    unmeasured.spill = {}
    with (
        pytest.warns(UserWarning, match="no spill times"),
        pytest.raises(
            ValueError, match=r"Spilled on one device: the profile has no spill times .*`lightning-varuna profile`"
        ),
    ):
        choose_configs(unmeasured, 1, GLOBAL_BATCH, micro_batch_size=1, memory_bytes=BUDGET, spill_tiers=["host"])
    # Below what trains it spilled, the error names the smallest budget that does.
    with pytest.raises(ValueError, match=r"memory_budget=\d+"):
        choose_configs(profile, 1, GLOBAL_BATCH, micro_batch_size=1, memory_bytes=100_000, spill_tiers=["host"])
    # More processes than one never spill; the budget still leaves out the shapes it does not fit.
    ranked = choose_configs(profile, 4, GLOBAL_BATCH, micro_batch_size=1, memory_bytes=BUDGET, spill_tiers=["host"])
    assert ranked and all(not isinstance(p, SpilledPrediction) and max(p.memory_bytes) <= BUDGET for p in ranked)
    assert {p.config.pipeline_parallel_size for p in ranked} >= {2, 4}  # not 1: the whole model does not fit
    with pytest.raises(ValueError, match="start the job on one process"):
        choose_configs(profile, 2, GLOBAL_BATCH, micro_batch_size=1, memory_bytes=150_000, spill_tiers=["host"])
