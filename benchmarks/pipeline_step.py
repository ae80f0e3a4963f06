"""Step time and memory of one training step of examples/gpt.py's GPT, pipelined and not, side by side.

Run from the repository root (about 2 minutes on 2 CPU cores)::

    python benchmarks/pipeline_step.py

Every variant trains the same model (GPT, 8 layers, dim 128, block 64) on the same global batch of 16 windows, in
fresh processes:

* ``varuna-lightning-{1f1b,gpipe,zero-bubble}``: ``Trainer.fit`` with ``VarunaStrategy(pipeline_parallel_size=2,
  micro_batch_size=4, schedule=...)``; 2 processes (gloo), 4 micro-batches.
* ``varuna-runtime-{1f1b,gpipe,zero-bubble}``: lightning-varuna's ``StageRuntime`` driving the traced stage
  ``GraphModule`` (the ``Stage`` the strategy builds) without Lightning; 2 processes (gloo).
* ``torch-pipelining-{1f1b,gpipe,zero-bubble}``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` /
  ``ScheduleGPipe`` / ``ScheduleInterleavedZeroBubble`` (its zero-bubble schedule, at one stage per rank) on a
  ``pipeline()`` cut at the same CutPoint; 2 processes (gloo). Its stage modules step through their graphs with
  ``torch.fx.Interpreter``, as a user of ``pipeline()`` gets them.
* ``torch-pipelining-{1f1b,zero-bubble}-codegen``: the same with the stage modules built as lightning-varuna builds
  its own (run as FX generated code, under ``torch.export.unflatten._disable_interpreter()``): the same stages as
  ours.
* ``*-interleaved-mb{4,8}`` and ``*-1f1b-mb8``: interleaved 1F1B with 2 stages per rank (the model cut into 4 stages
  of 2 blocks, at ``cuts.1``, ``cuts.3``, ``cuts.5``; stages 0 and 2 on rank 0), at 4 and 8 micro-batches, through
  ``Trainer.fit`` + ``VarunaStrategy(schedule="interleaved-1f1b")``, our bare runtime, and torch's
  ``ScheduleInterleaved1F1B`` on the same stage modules (``-codegen``); 1F1B at 8 micro-batches beside them.
* ``ddp-lightning``: ``Trainer(strategy="ddp", devices=2)``, DataLoader batch 8 per replica.
* ``single-lightning``: ``Trainer(devices=1)``, DataLoader batch 16; ``single-bare``: the same without Lightning.

A step is forward + backward + ``AdamW.step`` (the model's own optimizer) + ``zero_grad``. The Lightning variants time
``on_train_batch_start`` -> ``on_train_batch_end`` with a Callback; the bare variants time the same work in a loop
(one barrier before it). The bare runtime sums the gradient of the tied embedding / LM head over the two stages
as VarunaStrategy does; torch.distributed.pipelining has no such sync and skips it (each of its stages keeps a copy
of the tied weight and trains it apart). The ``*-codegen-tied*`` variants add that sum to torch's schedule after each
step (over the copies, on the ranks that hold one), as a user of it must to train this GPT as one device does: ours
and torch's then do the same work. The ``dp-accumulate`` variants
run one stage x 2 replicas with ``accumulate_grad_batches=4``; their step is one optimizer step (4 batches).
The step time of a variant is the median over the timed steps after the warm-up, taken per rank; the table shows
the slowest rank. Every process runs ``torch.set_num_threads(1)`` (and ``OMP_NUM_THREADS=1``), so 2 processes on 2
cores are compared with 1 process on 1 core. Peak memory is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of each
rank at the end of its run; it includes the Python/torch/Lightning runtime, so the growth over the RSS right after
the imports is shown too (it includes the whole model each rank builds before it keeps only its stage). "params" is
what each rank holds. Before each variant the launcher waits (up to ``--max-wait`` s) for other processes to leave
the CPUs idle, and it reports how many cores they kept busy while the variant ran ("other load").

Writes the figures to ``benchmarks/results/pipeline_step.json`` (``--output`` elsewhere). Options: ``--steps``,
``--warmup``, ``--variants NAME ...``, ``--rounds N`` (run the variants N times in turn, so that a slow spell of the
machine touches all of them; each ratio is then also given per round) (see ``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch import Tensor
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, CharDataset, make_text  # noqa: E402

from lightning_varuna import VarunaStrategy  # noqa: E402
from lightning_varuna.pipeline.schedules import Action  # noqa: E402
from lightning_varuna.pipeline.stage import Stage  # noqa: E402
from lightning_varuna.pipeline.step import run_schedule  # noqa: E402
from lightning_varuna.profiling.processes import wait_all  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pipeline_step.json"
REFERENCE, SINGLE = "torch-pipelining-1f1b", "single-lightning"
NOISY = 0.1  # cores used by other processes during a variant above which its figures are flagged


@dataclass(frozen=True)
class Config:
    layers: int = 8
    dim: int = 128
    heads: int = 4
    block_size: int = 64
    batch_size: int = 16  # the global batch of every variant
    micro_batch_size: int = 4
    boundary: str = "cuts.3"  # the CutPoint where stage 1 starts in the bare pipelined variants (4 + 4 blocks)
    warmup: int = 5
    steps: int = 30

    @property
    def num_microbatches(self) -> int:
        return self.batch_size // self.micro_batch_size


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "varuna-lightning" | "varuna-runtime" | "torch-pipelining" | "ddp" | "single" | "single-bare"
    world_size: int
    schedule: str | None = None
    description: str = ""
    codegen: bool = False  # torch-pipelining: build the stages to run as FX generated code, as VarunaStrategy does
    stages: int = 2  # varuna-lightning: pipeline_parallel_size (the rest of the processes are replicas)
    stages_per_rank: int = 1  # interleaved: stages per rank (the model cut into stages x this many)
    microbatches: int = 0  # micro-batches per step (0: the config's)
    accumulate: int = 1  # varuna-lightning: accumulate_grad_batches; a step is then one optimizer step
    reduce_every_batch: bool = False  # varuna-lightning: all-reduce after every accumulated batch (timing only)
    # torch-pipelining: after each step, sum the gradient of the tied embedding / LM head over the copies torch's stages
    # keep of it (each stage its own, trained apart otherwise), as VarunaStrategy sums it over its stages.
    tied_sum: bool = False


VARIANTS = [
    Variant("varuna-lightning-1f1b", "varuna-lightning", 2, "1f1b", "Trainer.fit + VarunaStrategy, 2 stages, 1F1B"),
    Variant("varuna-lightning-gpipe", "varuna-lightning", 2, "gpipe", "Trainer.fit + VarunaStrategy, 2 stages, GPipe"),
    Variant(
        "varuna-lightning-zero-bubble",
        "varuna-lightning",
        2,
        "zero-bubble",
        "Trainer.fit + VarunaStrategy, 2 stages, zero-bubble (ZB-H1)",
    ),
    Variant("varuna-runtime-1f1b", "varuna-runtime", 2, "1f1b", "bare StageRuntime, 2 stages, 1F1B"),
    Variant("varuna-runtime-gpipe", "varuna-runtime", 2, "gpipe", "bare StageRuntime, 2 stages, GPipe"),
    Variant(
        "varuna-runtime-zero-bubble", "varuna-runtime", 2, "zero-bubble", "bare StageRuntime, 2 stages, zero-bubble"
    ),
    Variant("torch-pipelining-1f1b", "torch-pipelining", 2, "1f1b", "torch.distributed.pipelining Schedule1F1B"),
    Variant(
        "torch-pipelining-1f1b-codegen",
        "torch-pipelining",
        2,
        "1f1b",
        "torch.distributed.pipelining Schedule1F1B on stages run as FX generated code (as VarunaStrategy's)",
        codegen=True,
    ),
    Variant("torch-pipelining-gpipe", "torch-pipelining", 2, "gpipe", "torch.distributed.pipelining ScheduleGPipe"),
    Variant(
        "torch-pipelining-zero-bubble",
        "torch-pipelining",
        2,
        "zero-bubble",
        "torch.distributed.pipelining ScheduleInterleavedZeroBubble, one stage per rank",
    ),
    Variant(
        "torch-pipelining-zero-bubble-codegen",
        "torch-pipelining",
        2,
        "zero-bubble",
        "torch.distributed.pipelining ScheduleInterleavedZeroBubble on stages run as FX generated code (as ours)",
        codegen=True,
    ),
    Variant(
        "varuna-lightning-dp-accumulate",
        "varuna-lightning",
        2,
        "1f1b",
        "Trainer.fit + VarunaStrategy, 1 stage x 2 replicas, accumulate_grad_batches=4: one all-reduce per step",
        stages=1,
        accumulate=4,
    ),
    Variant(
        "varuna-lightning-dp-accumulate-reduce-every-batch",
        "varuna-lightning",
        2,
        "1f1b",
        "the same, all-reducing after every accumulated batch as before (timing only: it sums gradients twice)",
        stages=1,
        accumulate=4,
        reduce_every_batch=True,
    ),
    *(
        variant
        for mb in (4, 8)
        for variant in (
            Variant(
                f"varuna-lightning-interleaved-mb{mb}",
                "varuna-lightning",
                2,
                "interleaved-1f1b",
                f"Trainer.fit + VarunaStrategy, 2 ranks x 2 stages, interleaved 1F1B, {mb} micro-batches",
                stages_per_rank=2,
                microbatches=mb,
            ),
            Variant(
                f"varuna-runtime-interleaved-mb{mb}",
                "varuna-runtime",
                2,
                "interleaved-1f1b",
                f"bare StageRuntime, 2 ranks x 2 stages, interleaved 1F1B, {mb} micro-batches",
                stages_per_rank=2,
                microbatches=mb,
            ),
            Variant(
                f"torch-pipelining-interleaved-codegen-mb{mb}",
                "torch-pipelining",
                2,
                "interleaved-1f1b",
                f"torch.distributed.pipelining ScheduleInterleaved1F1B, 2 ranks x 2 stages, {mb} micro-batches, on "
                "stages run as FX generated code (as ours)",
                codegen=True,
                stages_per_rank=2,
                microbatches=mb,
            ),
            Variant(
                f"varuna-lightning-zbv-mb{mb}",
                "varuna-lightning",
                2,
                "zbv",
                f"Trainer.fit + VarunaStrategy, 2 ranks x 2 stages in a V, ZBV zero-bubble, {mb} micro-batches",
                stages_per_rank=2,
                microbatches=mb,
            ),
            Variant(
                f"varuna-runtime-zbv-mb{mb}",
                "varuna-runtime",
                2,
                "zbv",
                f"bare StageRuntime, 2 ranks x 2 stages in a V, ZBV zero-bubble, {mb} micro-batches",
                stages_per_rank=2,
                microbatches=mb,
            ),
            Variant(
                f"torch-pipelining-zbv-codegen-mb{mb}",
                "torch-pipelining",
                2,
                "zbv",
                f"torch.distributed.pipelining ScheduleZBVZeroBubble, 2 ranks x 2 stages in a V, {mb} micro-batches, "
                "on stages run as FX generated code (as ours)",
                codegen=True,
                stages_per_rank=2,
                microbatches=mb,
            ),
        )
    ),
    Variant(
        "varuna-runtime-1f1b-mb8",
        "varuna-runtime",
        2,
        "1f1b",
        "bare StageRuntime, 2 stages, 1F1B, 8 micro-batches",
        microbatches=8,
    ),
    Variant(
        "torch-pipelining-1f1b-codegen-mb8",
        "torch-pipelining",
        2,
        "1f1b",
        "torch.distributed.pipelining Schedule1F1B, 8 micro-batches, on stages run as FX generated code",
        codegen=True,
        microbatches=8,
    ),
    Variant("ddp-lightning", "ddp", 2, None, "Trainer.fit + DDP, 2 replicas x batch 8"),
    Variant("single-lightning", "single", 1, None, "Trainer.fit, 1 process, batch 16"),
    Variant("single-bare", "single-bare", 1, None, "plain PyTorch loop, 1 process, batch 16 (no Lightning)"),
]
# torch's schedules on our stage modules doing our work: the tied weight's gradient summed over its copies, as a user of
# torch.distributed.pipelining must to train this GPT as one device does.
VARIANTS += [
    replace(
        v, name=v.name.replace("-codegen", "-codegen-tied"), tied_sum=True, description=v.description + ", tied sum"
    )
    for v in VARIANTS
    if v.codegen and v.schedule in ("1f1b", "interleaved-1f1b")
]


# ------------------------------------------------------------------------------------------------ model and data
def micro_batch_size_of(cfg: Config, variant: Variant) -> int:
    return cfg.batch_size // variant.microbatches if variant.microbatches else cfg.micro_batch_size


def boundaries_of(cfg: Config, variant: Variant) -> list[str]:
    """Where the bare pipelined variants cut: at ``cfg.boundary``, or into 2 x stages_per_rank equal stages."""
    if variant.stages_per_rank == 1:
        return [cfg.boundary]
    blocks = cfg.layers // (2 * variant.stages_per_rank)
    return [f"cuts.{blocks * k - 1}" for k in range(1, 2 * variant.stages_per_rank)]


def make_data(cfg: Config) -> CharDataset:
    return CharDataset(make_text(), block_size=cfg.block_size)


def make_model(cfg: Config, vocab_size: int) -> GPT:
    L.seed_everything(0, verbose=False)
    return GPT(vocab_size, block_size=cfg.block_size, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads)


def global_batches(cfg: Config, data: CharDataset) -> list[tuple[Tensor, Tensor]]:
    """The first ``warmup + steps`` global batches, in DataLoader order epoch after epoch (what the Lightning
    variants see); every batch is whole."""
    loader = DataLoader(data, batch_size=cfg.batch_size, drop_last=True)
    epochs = itertools.chain.from_iterable(itertools.repeat(loader))
    return list(itertools.islice(epochs, cfg.warmup + cfg.steps))


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def param_bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb() -> float:
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


# ------------------------------------------------------------------------------------------ Lightning variants
class StepTimer(L.Callback):
    """Wall time of each optimizer step (the first batch's start -> the last batch's end, ``accumulate`` batches)
    and of its forward + backward part."""

    def __init__(self, accumulate: int = 1) -> None:
        self.accumulate = accumulate
        self.step_s: list[float] = []
        self.fwd_bwd_s: list[float] = []
        self._start = self._before_optimizer = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx % self.accumulate == 0:
            self._start = time.perf_counter()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._before_optimizer = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if (idx + 1) % self.accumulate:
            return
        end = time.perf_counter()
        self.step_s.append(end - self._start)
        self.fwd_bwd_s.append(self._before_optimizer - self._start)


class ReduceEveryBatch(VarunaStrategy):
    """VarunaStrategy reducing gradients after every accumulated batch, as it did before it reduced once per
    optimizer step. For timing only: it all-reduces the same bytes, but sums the earlier batches' gradients again."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Any:
        yield


def run_lightning(cfg: Config, variant: Variant) -> dict[str, Any]:
    data = make_data(cfg)
    model = make_model(cfg, len(data.vocab))
    if variant.kind == "varuna-lightning":
        strategy_class = ReduceEveryBatch if variant.reduce_every_batch else VarunaStrategy
        strategy: Any = strategy_class(
            pipeline_parallel_size=variant.stages,
            micro_batch_size=micro_batch_size_of(cfg, variant),
            schedule=variant.schedule,
            stages_per_rank=variant.stages_per_rank if variant.stages_per_rank > 1 else None,
        )
        loader_batch = cfg.batch_size * variant.stages // variant.world_size
    elif variant.kind == "ddp":
        strategy, loader_batch = "ddp", cfg.batch_size // variant.world_size
    else:
        strategy, loader_batch = "auto", cfg.batch_size
    timer = StepTimer(variant.accumulate)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=variant.world_size,
        strategy=strategy,
        max_steps=cfg.warmup + cfg.steps,
        callbacks=[timer],
        accumulate_grad_batches=variant.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=loader_batch, drop_last=True))
    stages = getattr(trainer.strategy, "_stages", None)  # VarunaStrategy's plan: where it cut (read only)
    return {
        "rank": trainer.global_rank,
        "step_s": timer.step_s[cfg.warmup :],
        "fwd_bwd_s": timer.fwd_bwd_s[cfg.warmup :],
        "param_bytes": param_bytes(model.parameters()),  # on a pipelined rank: its stage's parameters only
        "boundary": stages.boundaries if stages is not None else None,
    }


# ----------------------------------------------------------------------------------- bare pipelined variants
def time_steps(
    cfg: Config, batches: list[tuple[Tensor, Tensor]], forward_backward: Callable[[Tensor, Tensor], None], params: list
) -> dict[str, list[float]]:
    """Run forward + backward + AdamW step on every batch; keep the times of the steps after the warm-up."""
    optimizer = torch.optim.AdamW(params, lr=3e-3)  # GPT.configure_optimizers
    step_s, fwd_bwd_s = [], []
    if dist.is_initialized():
        dist.barrier()  # once: in steady state each rank's step time is then the pipeline's period, as in Lightning
    for x, y in batches:
        start = time.perf_counter()
        forward_backward(x, y)
        backward_done = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        step_s.append(end - start)
        fwd_bwd_s.append(backward_done - start)
    return {"step_s": step_s[cfg.warmup :], "fwd_bwd_s": fwd_bwd_s[cfg.warmup :]}


def run_bare_step(stage: Stage, actions: list[Action], xs: tuple[Tensor, ...], ys: tuple[Tensor, ...]) -> None:
    """One step of ``stage`` under ``actions``, walked by the loop `MicroBatchedStep` uses (`run_schedule`) on the
    bare runtime, without a LightningModule around: each micro-batch's LM loss over their number."""

    def forward(index: int, m: int, recompute_later: bool) -> Tensor | None:
        graph, stage_module = stage.stage_for((xs[m],), {}, index)
        next_alike = m + 1 < len(xs) and xs[m + 1].shape == xs[m].shape
        return stage.runtime.forward(
            m, graph, stage_module, [xs[m]], True, stage=index, recompute_later=recompute_later, next_alike=next_alike
        )

    def loss_of(m: int, logits: Tensor | None) -> Tensor | None:
        return None if logits is None else lm_loss(logits, ys[m]) / len(xs)

    run_schedule(stage.runtime, actions, forward, loss_of)


def run_varuna_runtime(cfg: Config, variant: Variant) -> dict[str, Any]:
    """lightning-varuna's StageRuntime on the stage that VarunaStrategy would build, without Lightning."""

    from lightning_varuna.pipeline.gradients import reduce_gradients
    from lightning_varuna.pipeline.schedules import V_SHAPED, make_schedule
    from lightning_varuna.pipeline.shared_params import SharedParameters
    from lightning_varuna.pipeline.topology import Topology

    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(cfg)
    model = make_model(cfg, len(data.vocab)).train()
    batches = global_batches(cfg, data)
    mb = micro_batch_size_of(cfg, variant)
    example = batches[0][0][:mb]
    topology = Topology.from_world(world, rank, world, None, variant.stages_per_rank, variant.schedule in V_SHAPED)
    plan = Stage(model, boundaries_of(cfg, variant), topology, example.device)
    graph, stage_module = plan.stage_for((example,), {})
    plan.release_other_stages(graph)
    plan.shared = SharedParameters(graph.stage_parameters, topology, dict(model.named_parameters()))
    params = plan.own_parameters()
    actions = make_schedule(variant.schedule, world, cfg.batch_size // mb, variant.stages_per_rank)[topology.pp_rank]

    def forward_backward(x: Tensor, y: Tensor) -> None:
        run_bare_step(plan, actions, x.split(mb), y.split(mb))
        # The tied embedding / LM head gradient summed over the two stages, as VarunaStrategy does.
        for p, grad in zip(params, reduce_gradients(params, [p.grad for p in params], None, 1, plan.shared)):
            p.grad = grad

    timings = time_steps(cfg, batches, forward_backward, params)
    return {"rank": rank, **timings, "param_bytes": param_bytes(params), "boundary": boundaries_of(cfg, variant)}


def _skip_warmup_messages_to_self(stages: list[Any]) -> None:
    """torch's first step exchanges a dummy tensor with each stage's neighbours to connect them, also with a neighbour
    on its own rank (the V's middle stages), which gloo refuses ("Pair is not connected"); its schedule itself passes
    values between two stages of one rank without a message. Leave those dummies out."""
    for stage in stages:
        warmup_ops = stage._get_init_p2p_neighbors_ops

        def to_others(warmup_ops: Any = warmup_ops, own: int = stage.group_rank) -> list[Any]:
            return [op for op in warmup_ops() if op.group_peer != own]

        stage._get_init_p2p_neighbors_ops = to_others


def run_torch_pipelining(cfg: Config, variant: Variant) -> dict[str, Any]:
    """torch.distributed.pipelining's schedules on the model cut at the same CutPoint."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        pipeline,
    )

    from lightning_varuna._torch_private import generated_code_modules

    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(cfg)
    model = make_model(cfg, len(data.vocab)).train()
    batches = global_batches(cfg, data)
    mb = micro_batch_size_of(cfg, variant)
    microbatches = cfg.batch_size // mb
    for boundary in boundaries_of(cfg, variant):
        model.get_submodule(boundary)._is_stage_boundary = True  # the CutPoint then calls pipe_split()
    with generated_code_modules() if variant.codegen else contextlib.nullcontext():
        pipe = pipeline(model, mb_args=(batches[0][0][:mb],))
    # Round-robin, as ours: rank r runs stages r, r + world, ... (torch's default stage -> rank map); in a V for ZBV.
    held = (
        [rank, 2 * world - 1 - rank]
        if variant.schedule == "zbv"
        else range(rank, world * variant.stages_per_rank, world)
    )
    stages = [pipe.build_stage(stage, torch.device("cpu")) for stage in held]
    sum_tied = _tied_gradient_sum(pipe, stages) if variant.tied_sum else None
    if variant.schedule == "zbv":
        _skip_warmup_messages_to_self(stages)
    del pipe, model
    if variant.schedule in ("zero-bubble", "interleaved-1f1b", "zbv"):  # schedules of several stages per rank
        schedule_cls: Any = {
            "zero-bubble": ScheduleInterleavedZeroBubble,
            "interleaved-1f1b": ScheduleInterleaved1F1B,
            "zbv": ScheduleZBVZeroBubble,
        }
        schedule: Any = schedule_cls[variant.schedule](stages, n_microbatches=microbatches, loss_fn=lm_loss)
    else:
        schedule_cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[variant.schedule]
        schedule = schedule_cls(stages[0], n_microbatches=microbatches, loss_fn=lm_loss)  # grads scaled by 1/M
    params = [p for stage in stages for p in stage.submod.parameters()]

    def forward_backward(x: Tensor, y: Tensor) -> None:
        schedule.step(x, target=y, losses=[])
        if sum_tied is not None:
            sum_tied()

    timings = time_steps(cfg, batches, forward_backward, params)
    return {"rank": rank, **timings, "param_bytes": param_bytes(params), "boundary": boundaries_of(cfg, variant)}


def _tied_gradient_sum(pipe: Any, stages: list[Any]) -> Callable[[], None]:
    """A function that sums the gradients of the copies torch's stages keep of a parameter that several stages use
    (`Pipe.replicated_params`: each stage trains its own copy otherwise) over the ranks that hold one, and gives each
    copy the sum. All ranks call this set-up together."""
    groups = []
    for uses in pipe.replicated_params:  # {stage module name: the parameter's name in it}
        modules = {id(getattr(pipe.split_gm, name)): qualname for name, qualname in uses.items()}
        copies = [
            stage.submod.get_parameter(modules[id(stage.submod)]) for stage in stages if id(stage.submod) in modules
        ]
        held = [0] * dist.get_world_size()
        dist.all_gather_object(held, len(copies))
        if sum(held) != len(uses):
            raise RuntimeError(f"Found {sum(held)} copies of a parameter that {len(uses)} stages use: {uses}")
        holders = [rank for rank, n in enumerate(held) if n]
        groups.append((copies, dist.new_group(holders), len(holders)))

    def sum_tied() -> None:
        for copies, group, holders in groups:
            if not copies:
                continue
            total = torch.stack([p.grad for p in copies]).sum(0)
            if holders > 1:
                dist.all_reduce(total, group=group)
            for p in copies:
                p.grad = total.clone()

    return sum_tied


def run_single_bare(cfg: Config, variant: Variant) -> dict[str, Any]:
    """The whole model in one process, a plain PyTorch loop: the reference without Lightning."""
    data = make_data(cfg)
    model = make_model(cfg, len(data.vocab)).train()
    params = list(model.parameters())

    def forward_backward(x: Tensor, y: Tensor) -> None:
        lm_loss(model(x), y).backward()

    timings = time_steps(cfg, global_batches(cfg, data), forward_backward, params)
    return {"rank": 0, **timings, "param_bytes": param_bytes(params), "boundary": None}


# ---------------------------------------------------------------------------------------------------- worker
def worker(variant_name: str, cfg: Config, out_dir: Path) -> None:
    """One process of one variant: run it, write this rank's figures to ``out_dir/rank{r}.json``."""
    torch.set_num_threads(1)
    base_rss_mb = current_rss_mb()  # torch, Lightning and the model code are imported; nothing is built yet
    variant = next(v for v in VARIANTS if v.name == variant_name)
    bare = variant.kind in ("varuna-runtime", "torch-pipelining")
    if bare:
        dist.init_process_group("gloo")
    try:
        bare_runs = {
            "varuna-runtime": run_varuna_runtime,
            "torch-pipelining": run_torch_pipelining,
            "single-bare": run_single_bare,
        }
        run = bare_runs.get(variant.kind, run_lightning)
        result = run(cfg, variant)
    finally:
        if bare:
            dist.destroy_process_group()
    result.update(peak_rss_mb=peak_rss_mb(), base_rss_mb=base_rss_mb, num_threads=torch.get_num_threads())
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ machine load monitoring
def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from ``/proc/stat``."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the benchmark's workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


class LoadMeter:
    """How many cores other processes kept busy (and the hypervisor stole) between ``start`` and ``stop``."""

    def start(self) -> None:
        self._t, (self._busy, self._steal), self._own = time.monotonic(), machine_cpu_seconds(), own_cpu_seconds()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self._t
        busy, steal = machine_cpu_seconds()
        foreign = (busy - self._busy) - (own_cpu_seconds() - self._own)
        other, stolen = max(foreign, 0.0) / wall, (steal - self._steal) / wall
        return {"other_cores": round(other, 2), "steal_cores": round(stolen, 2)}


def wait_until_quiet(max_wait_s: float, threshold: float = 0.15, window_s: float = 2.0) -> float:
    """Wait until other processes use less than ``threshold`` cores (at most ``max_wait_s``); return their load."""
    meter, deadline, reported = LoadMeter(), time.monotonic() + max_wait_s, False
    while True:
        meter.start()
        time.sleep(window_s)
        load = meter.stop()["other_cores"]
        if load < threshold or time.monotonic() > deadline:
            return load
        if not reported:
            print(f"  (other processes keep {load:.1f} cores busy; waiting up to {max_wait_s:.0f} s)", flush=True)
            reported = True


# -------------------------------------------------------------------------------------------------- launcher
def launch(variant: Variant, cfg: Config, timeout_s: float) -> list[dict[str, Any]]:
    """Start ``world_size`` fresh processes of this script for ``variant``; return each rank's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        if variant.world_size > 1:  # torch.distributed env:// rendezvous; Lightning then creates no processes
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()), NODE_RANK="0")
            env.update(WORLD_SIZE=str(variant.world_size))
        config = json.dumps(asdict(cfg))
        command = [sys.executable, __file__, "--worker", variant.name, "--config", config, "--out", tmp]
        procs = []
        for rank in range(variant.world_size):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if variant.world_size > 1 else env
            with open(out / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(command, env=rank_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        wait_all(procs, [out / f"rank{r}.log" for r in range(len(procs))], timeout_s, variant.name)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(variant.world_size)]


def summarize(variant: Variant, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    def ms(key: str) -> list[float]:
        return [round(1000 * statistics.median(r[key]), 2) for r in ranks]

    step, fwd_bwd = ms("step_s"), ms("fwd_bwd_s")
    return {
        "variant": variant.name,
        "description": variant.description,
        "processes": variant.world_size,
        "step_ms": max(step),  # the slowest rank's median
        "fwd_bwd_ms": max(fwd_bwd),
        "step_ms_per_rank": step,
        "fwd_bwd_ms_per_rank": fwd_bwd,
        "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in ranks],
        "peak_rss_above_import_mb_per_rank": [round(r["peak_rss_mb"] - r["base_rss_mb"], 1) for r in ranks],
        "param_mb_per_rank": [round(r["param_bytes"] / 2**20, 2) for r in ranks],
        "num_threads": sorted({r["num_threads"] for r in ranks}),
        "boundary": ranks[0].get("boundary"),
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    by_name = {row["variant"]: row for row in rows}
    for row in rows:
        for key, ref in (("vs_torch_pipelining_1f1b", REFERENCE), ("vs_single", SINGLE)):
            row[key] = round(row["step_ms"] / by_name[ref]["step_ms"], 2) if ref in by_name else None


def header(cfg: Config) -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "threads_per_process": 1,
        "config": {**asdict(cfg), "num_microbatches": cfg.num_microbatches},
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = [
        "| variant | procs | step ms (median) | fwd+bwd ms | vs torch-pipelining 1F1B | vs single process "
        "| peak RSS MB per rank | of which after imports | params MB per rank | other load (cores) |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for r in rows:
        rss = " / ".join(f"{v:.0f}" for v in r["peak_rss_mb_per_rank"])
        grown = " / ".join(f"{v:.0f}" for v in r["peak_rss_above_import_mb_per_rank"])
        params = " / ".join(f"{v:.2f}" for v in r["param_mb_per_rank"])
        lines.append(
            f"| {r['variant']} | {r['processes']} | {r['step_ms']:.1f} | {r['fwd_bwd_ms']:.1f} "
            f"| {ratio(r['vs_torch_pipelining_1f1b'])} | {ratio(r['vs_single'])} | {rss} | {grown} | {params} "
            f"| {r['other_cores']:.2f} |"
        )
    return "\n".join(lines)


COMPARISONS = [
    (
        "Lightning's cost (Trainer + VarunaStrategy over the bare runtime), 1F1B",
        "varuna-lightning-1f1b",
        "varuna-runtime-1f1b",
    ),
    ("Lightning's cost, GPipe", "varuna-lightning-gpipe", "varuna-runtime-gpipe"),
    ("zero-bubble over 1F1B, Trainer + VarunaStrategy", "varuna-lightning-zero-bubble", "varuna-lightning-1f1b"),
    ("zero-bubble over 1F1B, bare runtime", "varuna-runtime-zero-bubble", "varuna-runtime-1f1b"),
    (
        "zero-bubble: bare runtime over torch's on the same stage modules",
        "varuna-runtime-zero-bubble",
        "torch-pipelining-zero-bubble-codegen",
    ),
    (
        "zero-bubble over 1F1B, torch on the same stage modules",
        "torch-pipelining-zero-bubble-codegen",
        "torch-pipelining-1f1b-codegen",
    ),
    *(
        comparison
        for mb in (4, 8)
        for comparison in (
            (
                f"interleaved (2 stages per rank) over 1F1B, Trainer + VarunaStrategy, {mb} micro-batches",
                f"varuna-lightning-interleaved-mb{mb}",
                "varuna-lightning-1f1b" if mb == 4 else "",
            ),
            (
                f"interleaved over 1F1B, bare runtime, {mb} micro-batches",
                f"varuna-runtime-interleaved-mb{mb}",
                "varuna-runtime-1f1b" if mb == 4 else "varuna-runtime-1f1b-mb8",
            ),
            (
                f"interleaved: bare runtime over torch's ScheduleInterleaved1F1B on the same stage modules, {mb} "
                "micro-batches",
                f"varuna-runtime-interleaved-mb{mb}",
                f"torch-pipelining-interleaved-codegen-mb{mb}",
            ),
            (
                f"interleaved: bare runtime over torch's ScheduleInterleaved1F1B on the same stage modules, with "
                f"the tied sum, {mb} micro-batches",
                f"varuna-runtime-interleaved-mb{mb}",
                f"torch-pipelining-interleaved-codegen-tied-mb{mb}",
            ),
            (
                f"1F1B: bare runtime over torch's Schedule1F1B on the same stage modules with the tied sum, {mb} "
                "micro-batches",
                "varuna-runtime-1f1b" if mb == 4 else "varuna-runtime-1f1b-mb8",
                "torch-pipelining-1f1b-codegen-tied" if mb == 4 else "torch-pipelining-1f1b-codegen-tied-mb8",
            ),
            (
                f"interleaved over 1F1B, torch on the same stage modules, {mb} micro-batches",
                f"torch-pipelining-interleaved-codegen-mb{mb}",
                "torch-pipelining-1f1b-codegen" if mb == 4 else "torch-pipelining-1f1b-codegen-mb8",
            ),
            (
                f"ZBV: bare runtime over torch's ScheduleZBVZeroBubble on the same stage modules, {mb} micro-batches",
                f"varuna-runtime-zbv-mb{mb}",
                f"torch-pipelining-zbv-codegen-mb{mb}",
            ),
            (
                f"interleaved, Trainer + VarunaStrategy, over torch's Schedule1F1B as users get it, {mb} micro-batches",
                f"varuna-lightning-interleaved-mb{mb}",
                "torch-pipelining-1f1b" if mb == 4 else "",
            ),
            (
                f"ZBV, Trainer + VarunaStrategy, over torch's Schedule1F1B as users get it, {mb} micro-batches",
                f"varuna-lightning-zbv-mb{mb}",
                "torch-pipelining-1f1b" if mb == 4 else "",
            ),
        )
    ),
    (
        "one all-reduce per optimizer step instead of one per accumulated batch",
        "varuna-lightning-dp-accumulate",
        "varuna-lightning-dp-accumulate-reduce-every-batch",
    ),
]


def comparisons(rows: list[dict[str, Any]]) -> list[str]:
    """The ratios the table is run for, as lines of text; with several rounds, also each round's ratio."""
    by_name = {row["variant"]: row for row in rows}
    lines = []
    for what, a, b in COMPARISONS:
        if a not in by_name or b not in by_name:
            continue
        line = f"{what}: {by_name[a]['step_ms']:.1f} / {by_name[b]['step_ms']:.1f} ms = "
        line += f"{by_name[a]['step_ms'] / by_name[b]['step_ms']:.3f}x"
        per_round = [x / y for x, y in zip(by_name[a]["step_ms_rounds"], by_name[b]["step_ms_rounds"])]
        if len(per_round) > 1:
            shown = ", ".join(f"{r:.3f}" for r in per_round)
            line += f"; per round {shown} (median {statistics.median(per_round):.3f}x)"
        lines.append(line)
    return lines


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a variant run in several rounds: the round with the median step time, with every round's."""
    ordered = sorted(rounds, key=lambda row: row["step_ms"])
    return {**ordered[(len(ordered) - 1) // 2], "step_ms_rounds": [row["step_ms"] for row in rounds]}


def measure(variant: Variant, cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Run a variant on a quiet machine; run it again (up to ``--retries`` times) if other processes disturbed it."""
    meter = LoadMeter()
    for attempt in range(args.retries + 1):
        wait_until_quiet(args.max_wait)
        meter.start()
        ranks = launch(variant, cfg, args.timeout)
        row = {**summarize(variant, ranks), **meter.stop(), "attempts": attempt + 1}
        disturbed = row["other_cores"] > NOISY
        print(
            f"  {variant.name:<28} {row['step_ms']:7.1f} ms/step   other load {row['other_cores']:.2f} cores"
            f"{'  <- disturbed' if disturbed else ''}",
            flush=True,
        )
        if not disturbed:
            break
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=Config.steps, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=Config.warmup, help="untimed steps first")
    parser.add_argument("--dim", type=int, default=Config.dim, help="the GPT's width (a small one: per-action costs)")
    parser.add_argument("--heads", type=int, default=Config.heads, help="attention heads (they divide --dim)")
    parser.add_argument("--block-size", type=int, default=Config.block_size, help="tokens per window")
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], default=[v.name for v in VARIANTS])
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the variants this many times, in turn; report each one's median run"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
    parser.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine per run")
    parser.add_argument("--retries", type=int, default=2, help="runs again of a variant that other processes disturbed")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to write the figures (JSON)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Config(**json.loads(args.config)), Path(args.out))
        return

    cfg = Config(steps=args.steps, warmup=args.warmup, dim=args.dim, heads=args.heads, block_size=args.block_size)
    meta = header(cfg)
    print(
        f"torch {meta['torch']}, lightning {meta['lightning']}, python {meta['python']}, {meta['cpu_count']} CPUs, "
        f"1 thread per process (torch.set_num_threads(1), OMP_NUM_THREADS=1)\n"
        f"GPT layers={cfg.layers} dim={cfg.dim} heads={cfg.heads} block={cfg.block_size}; global batch "
        f"{cfg.batch_size}, micro-batch {cfg.micro_batch_size} ({cfg.num_microbatches} micro-batches); "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps; step = fwd + bwd + AdamW",
        flush=True,
    )
    chosen = [v for v in VARIANTS if v.name in args.variants]
    rounds: dict[str, list[dict[str, Any]]] = {v.name: [] for v in chosen}
    for round_index in range(args.rounds):
        if args.rounds > 1:
            print(f"round {round_index + 1} of {args.rounds}", flush=True)
        for variant in chosen:
            rounds[variant.name].append(measure(variant, cfg, args))
    rows = [median_round(rounds[v.name]) for v in chosen]
    add_ratios(rows)
    boundaries = {r["variant"]: r["boundary"] for r in rows if r["boundary"]}
    print(f"\nstage boundary: bare variants {cfg.boundary}; VarunaStrategy chose {boundaries or '-'}\n")
    print(format_table(rows))
    for line in comparisons(rows):
        print(line)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
