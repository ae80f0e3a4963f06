"""VarunaStrategy is reachable the ways Lightning users select a strategy."""

from __future__ import annotations

import json
import os
import re
import sys

import lightning as L
import pytest
import torch
from conftest import clean_env, run_job, run_ranks
from models import TinyLM

from lightning_varuna import VarunaStrategy
from lightning_varuna.checkpoint.consolidate import consolidate

pytestmark = pytest.mark.slow  # real multi-process jobs

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_registered_name_selects_the_strategy():
    trainer = L.Trainer(strategy="varuna", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, VarunaStrategy)
    assert trainer.strategy.pipeline_parallel_size == 1


@pytest.mark.parametrize(
    "strategy_args",
    [
        [],  # the YAML's class_path + init_args
        ["--trainer.strategy=VarunaStrategy", "--trainer.strategy.pipeline_parallel_size=2"],
    ],
)
def test_lightning_cli_yaml_trains_pipelined(tmp_path, strategy_args):
    pytest.importorskip("jsonargparse")
    cmd = [
        os.path.join(EXAMPLES, "gpt_cli.py"),
        "fit",
        "--config",
        os.path.join(EXAMPLES, "gpt_cli.yaml"),
        "--trainer.devices=2",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--model.layers=2",
        *strategy_args,
    ]
    proc = run_job(cmd, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Where it cuts follows the segments' measured times, which a busy machine can tip to the other CutPoint.
    assert re.search(r"VarunaStrategy: 2 stage\(s\), cut at CutPoints \['cuts\.[01]'\]", proc.stderr + proc.stdout)
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in proc.stderr + proc.stdout


def test_lightning_cli_yaml_trains_spilled(tmp_path):
    """examples/gpt_spilling.yaml: SpillingStrategy with a disk tier, from the Lightning CLI."""
    pytest.importorskip("jsonargparse")
    cmd = [
        os.path.join(EXAMPLES, "gpt_cli.py"),
        "fit",
        "--config",
        os.path.join(EXAMPLES, "gpt_spilling.yaml"),
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.strategy.spill_dir={tmp_path / 'spill'}",
    ]
    proc = run_job(cmd, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SpillingStrategy: 5 segment(s) in 4 shard(s)" in proc.stderr + proc.stdout
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in proc.stderr + proc.stdout
    assert not (tmp_path / "spill").exists()  # made for the spilled shards, removed with them after training


def test_torchrun_launch(tmp_path):
    cmd = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        os.path.join(EXAMPLES, "gpt.py"),
        "--devices=2",
        "--max-steps=2",
        "--layers=2",
    ]
    proc = run_job(cmd, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "VarunaStrategy: 2 stage(s)" in proc.stderr + proc.stdout
    assert "final metrics" in proc.stdout


def test_sbatch_example_trains(tmp_path, slurm):
    """The README's SLURM job script, submitted as a user would (from the repository root)."""
    root = os.path.dirname(EXAMPLES)
    args = ["--max-steps=4", "--layers=2", f"--checkpoint-dir={tmp_path / 'checkpoints'}"]
    script = os.path.join(EXAMPLES, "gpt.sbatch")
    # The job runs `python` from PATH: this interpreter.
    env = {**clean_env(), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    job = slurm.sbatch_script(script, *args, cwd=root, output=tmp_path / "job.out", env=env)
    state = slurm.wait_until_ended(job, 300)
    output = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", output[-4000:]
    assert "VarunaStrategy: 2 stage(s)" in output
    assert "final metrics" in output


LR_FIND = """
import sys
sys.path.insert(0, {tests!r})
import torch
from lightning.pytorch.tuner import Tuner
from models import TinyLM, one_device_or_two_stages, token_dataset

torch.manual_seed(0)
model, data = TinyLM(), token_dataset(64)
pipelined = {pipelined}
trainer, loader = one_device_or_two_stages(pipelined, data, batch_size=4, max_steps=3)
found = Tuner(trainer).lr_find(model, train_dataloaders=loader, min_lr=1e-4, max_lr=1.0, num_training=12)
trainer.fit(model, loader)
if trainer.global_rank == 0:
    print("suggested", found.suggestion(), "lr", model.lr, "steps", trainer.global_step)
"""


def test_the_learning_rate_finder_runs_before_a_pipelined_fit(tmp_path):
    """`Tuner.lr_find` ends its search by a control-flow exception on every rank, which is not a failure of the job:
    the suggestion is plain Lightning's, and the fit after it trains."""
    outputs = []
    for pipelined in (False, True):
        script = tmp_path / f"lr_find_{pipelined}.py"
        script.write_text(LR_FIND.format(tests=os.path.dirname(__file__), pipelined=pipelined))
        proc = run_ranks([str(script)], 2 if pipelined else 1, tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        outputs.append(re.search(r"suggested (\S+) lr (\S+) steps (\d+)", proc.stdout).groups())  # type: ignore[union-attr]
    plain, pipelined_run = outputs
    assert pipelined_run == plain
    assert pipelined_run[2] == "3"


RANK_ZERO_CODE = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader
from models import TinyLM, token_dataset
from lightning_varuna import VarunaStrategy


class LogsItself(TinyLM):
    \"\"\"Epoch-end hooks that call the logger directly and run rank-zero code, as Lightning's docs show.\"\"\"

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.val_rows = [*getattr(self, "val_rows", []), len(batch[0])]

    def on_validation_epoch_end(self):
        self.logger.log_metrics({{"val_rows_kept": sum(self.val_rows)}}, step=self.global_step)
        self.val_rows = []
        self.write_note()

    @rank_zero_only
    def write_note(self):
        with open("notes.txt", "a") as notes:
            notes.write(f"epoch {{self.current_epoch}} by rank {{self.global_rank}}\\n")


torch.manual_seed(0)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=VarunaStrategy(pipeline_parallel_size=2), max_epochs=2,
                    logger=CSVLogger("logs", name="", version=""), enable_checkpointing=False,
                    enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=2)
trainer.fit(LogsItself(), DataLoader(token_dataset(16), batch_size=4), DataLoader(token_dataset(16), batch_size=4))
"""


def test_rank_zero_code_in_an_epoch_end_hook_runs_where_the_steps_kept_their_outputs(tmp_path):
    """Rank 0 holds the last stage, where the steps ran past `self(...)` and the epoch-end hooks run: a logger called
    directly there and a `@rank_zero_only` method take effect once, with what the steps kept (before, rank 0 was a
    first stage and skipped the hook, and on the last stage rank-zero code did nothing)."""
    script = tmp_path / "rank_zero_code.py"
    script.write_text(RANK_ZERO_CODE.format(tests=os.path.dirname(__file__)))
    proc = run_ranks([str(script)], 2, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "notes.txt").read_text().splitlines() == ["epoch 0 by rank 0", "epoch 1 by rank 0"]
    metrics = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()
    kept = [row.split(",")[metrics[0].split(",").index("val_rows_kept")] for row in metrics[1:]]
    assert [value for value in kept if value] == ["8", "8"]  # the rows of the 2 validation batches of 4


FINETUNING = """
import ast
import json
import os
import sys
sys.path.insert(0, {tests!r})
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from models import DIM, VOCAB, Block, one_device_or_two_stages, token_dataset
from lightning_varuna import CutPoint


class Finetuned(L.LightningModule):
    def __init__(self, backbone_blocks):
        super().__init__()
        self.backbone = nn.ModuleList([nn.Embedding(VOCAB, DIM), *(Block(DIM) for _ in range(backbone_blocks))])
        self.top = nn.ModuleList(Block(DIM) for _ in range(4 - backbone_blocks))
        self.cut = CutPoint()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        keep = (idx != 0).unsqueeze(-1).float()
        x = self.backbone[0](idx)
        for i, block in enumerate([*self.backbone[1:], *self.top]):
            x = block(x, keep)
            if i == 1:
                x = self.cut(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]).flatten(0, 1), batch[1].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # the trainable parameters only, as Lightning's finetuning docs show
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


torch.manual_seed(0)
model, data = Finetuned({backbone_blocks}), token_dataset(32)
pipelined = {pipelined}
finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
trainer, loader = one_device_or_two_stages(pipelined, data, batch_size=8, max_epochs=3, callbacks=[finetuning])
trainer.fit(model, loader)
lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
loss = float(trainer.callback_metrics["train_loss"])
os.write(1, f"rank {{trainer.global_rank}} loss {{loss}} lrs {{lrs}}\\n".encode())  # one write: the ranks share stdout
"""


@pytest.mark.parametrize("backbone_blocks", [2, 1], ids=["backbone-is-stage-0", "backbone-on-both-stages"])
def test_a_frozen_backbone_is_finetuned_pipelined_as_on_one_device(tmp_path, backbone_blocks):
    """A frozen first stage gets an optimizer over none of its parameters, and `BackboneFinetuning` later adds the
    backbone's as a group on every stage: each stage has one device's groups and learning rates, and the loss is one
    device's."""
    lines = []
    for pipelined in (False, True):
        script = tmp_path / f"finetune_{pipelined}.py"
        script.write_text(
            FINETUNING.format(tests=os.path.dirname(__file__), pipelined=pipelined, backbone_blocks=backbone_blocks)
        )
        proc = run_ranks([str(script)], 2 if pipelined else 1, tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines.append(sorted(re.findall(r"rank (\d) loss (\S+) lrs (\[[^\]]*\])", proc.stdout)))
    (plain,), stages = lines
    assert [lrs for _, _, lrs in stages] == [plain[2]] * 2  # the same groups' learning rates on both stages
    assert abs(float(stages[0][1]) - float(plain[1])) < 1e-5 * abs(float(plain[1]))


KEPT_ASIDE = """
import sys
sys.path.insert(0, {tests!r})
import torch
from torch import nn
from models import DIM, TinyLM, one_device_or_two_stages, token_dataset


class Bands(nn.Module):
    '''A table computed once and read by the module's own `_apply` (as timm's rotary embedding).'''

    def __init__(self):
        super().__init__()
        self.register_buffer("bands", torch.arange(4.0))

    def _apply(self, fn, recurse=True):
        assert self.bands.dtype == torch.float32
        return super()._apply(fn, recurse)


class KeptAside(TinyLM):
    '''A frozen block and a frozen weight tied across the first and last stage under AdamW over all parameters, and
    tensors the forward never uses: a frozen copy kept beside what replaced it (as peft's `modules_to_save`) and a
    table.'''

    def __init__(self):
        super().__init__()
        self.blocks[0].requires_grad_(False)
        self.emb.requires_grad_(False)  # and the head, tied to it
        self.spare = nn.Linear(DIM, DIM).requires_grad_(False)
        self.rotary = Bands()


torch.manual_seed(0)
model, data = KeptAside(), token_dataset(32)
pipelined = {pipelined}
trainer, loader = one_device_or_two_stages(pipelined, data, batch_size=8, max_steps=4, enable_model_summary=False)
trainer.fit(model, loader)
trainer.save_checkpoint({path!r})
trainer.validate(model, loader, verbose=False)  # moves the module to the device again
"""


def test_frozen_and_unused_tensors_are_kept_and_saved_pipelined_as_on_one_device(tmp_path):
    """A frozen parameter in the optimizer got a zero gradient, and AdamW's weight decay moved it; tensors no stage
    uses were freed on every rank and never saved, and Lightning's moves of the module (to the CPU at the end of
    `fit`, to the device as `validate` begins) failed in a module's `_apply` that read one. Now the checkpoint holds
    what one device's does."""
    saved = {}
    for pipelined in (False, True):
        script, path = tmp_path / f"kept_aside_{pipelined}.py", tmp_path / f"kept_aside_{pipelined}.ckpt"
        script.write_text(KEPT_ASIDE.format(tests=os.path.dirname(__file__), pipelined=pipelined, path=str(path)))
        proc = run_ranks([str(script)], 2 if pipelined else 1, tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        saved[pipelined] = consolidate(str(path)) if pipelined else torch.load(path, weights_only=False)
    plain, pipelined = (saved[p]["state_dict"] for p in (False, True))
    assert pipelined.keys() == plain.keys() and {"spare.weight", "rotary.bands"} <= plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(pipelined[name], value, rtol=1e-5, atol=1e-6, msg=name)


USED_WHOLE = """
import json, sys, warnings
sys.path.insert(0, {tests!r})
import lightning as L
import torch
from models import TinyLM, one_device_or_two_stages, token_dataset

torch.manual_seed(0)
model = TinyLM()
trainer, loader = one_device_or_two_stages(True, token_dataset(16), batch_size=4, max_steps=2)
trainer.fit(model, loader)
seen = {{}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.save_checkpoint({path!r})
    trainer.validate(model, loader, verbose=False)
    seen["quiet"] = [str(w.message) for w in caught]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    seen["entries"] = len(model.state_dict())
    seen["state_dict"] = [str(w.message) for w in caught]
try:
    one_device_or_two_stages(True, token_dataset(16), batch_size=4, max_steps=2)[0].fit(model, loader)
except RuntimeError as error:
    seen["fit_again"] = str(error)
with open(f"rank{{trainer.global_rank}}.json", "w") as f:
    json.dump(seen, f)
"""


def test_a_model_used_whole_after_a_pipelined_fit_says_each_process_holds_one_stage(tmp_path):
    """After a fit at 2 stages each process holds its own stage's tensors: a second `fit` on the same module under
    a new Trainer failed inside torch (``linear(): argument 'weight' must be Tensor, not NoneType``) and a
    `state_dict` was silently incomplete. Now the first raises an error that says what to do and the second warns,
    while the same Trainer's checkpoint and validation stay quiet."""
    script = tmp_path / "used_whole.py"
    path = tmp_path / "after_fit.ckpt"
    script.write_text(USED_WHOLE.format(tests=os.path.dirname(__file__), path=str(path)))
    proc = run_ranks([str(script)], 2, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    whole = len(TinyLM().state_dict())
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not [m for m in seen["quiet"] if "VarunaStrategy" in m], seen["quiet"]
        assert 0 < seen["entries"] < whole
        assert len(set(seen["state_dict"])) == 1 and "holds only stage" in seen["state_dict"][0]
        assert re.search(r"runs without its tensors .* holds only stage \d of 2's", seen["fit_again"])
        assert "lightning-varuna consolidate" in seen["fit_again"]
    assert sorted(consolidate(str(path))["state_dict"]) == sorted(TinyLM().state_dict())


def test_callbacks_that_watch_the_validation_loss_act_pipelined_and_spilled_as_on_one_device(tmp_path):
    """`EarlyStopping`, `ReduceLROnPlateau` and a top-k `ModelCheckpoint` on ``val_loss`` (which the last stage
    computes) stop, halve the learning rate and keep checkpoints at the epochs one device does; testing and
    predicting from the best checkpoint give one device's metrics and predictions (`run_monitored_fit`): at 2 stages
    and spilled in 3 shards."""
    results = {}
    for mode, ranks in (("one", 1), ("pipelined", 2), ("spilled", 1)):
        proc = run_ranks([os.path.join(os.path.dirname(__file__), "run_monitored_fit.py"), str(tmp_path / mode), mode],
                         ranks, tmp_path, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[mode] = json.loads((tmp_path / mode / "result.json").read_text())
    one = results.pop("one")
    assert results["spilled"]["shards"] == 3
    assert one["rates"][0] > one["rates"][-1] and 0 < one["stopped_epoch"] < 29  # the callbacks acted
    for mode, result in results.items():
        for key in ("rates", "stopped_epoch", "best", "kept", "predicted"):
            assert result[key] == one[key], (mode, key)
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5, msg=mode)
        assert result["tested"][0]["test_loss"] == pytest.approx(one["tested"][0]["test_loss"], rel=1e-4), mode
