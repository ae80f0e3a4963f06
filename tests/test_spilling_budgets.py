"""SpillingStrategy at the budgets users pick: the smallest that trains is named and trains, a shard too large to
have the next one fetched beside it trains without prefetch, activations are kept where the budget has room (and
computed again in backward only where it has not), a budget as a share of the device, and the disk tier's folder."""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from models import TinyLM
from spilled_runs import BUDGETS, FrozenEmbeddingLM, StepLosses, assert_same_model, fit, fit_mlp, losses
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_varuna import SpillingStrategy, cut_after
from lightning_varuna.demos import MLP
from lightning_varuna.partition.packing import SegmentMemory, pack_shards, parse_bytes


def segments(*needs: tuple[int, int]) -> list[SegmentMemory]:
    return [SegmentMemory(f"segment {i}", state, activations) for i, (state, activations) in enumerate(needs)]


# ----------------------------------------------------------------------------------------------------- packing
def test_packing_keeps_the_activations_that_fit_without_more_shards():
    """Each segment needs 10 of state and 4 of activations. With room for all activations (12 beside the shards)
    every shard keeps them; with less, only the last segments' are kept; with none, all are computed again."""
    memory = segments(*[(10, 4)] * 3)
    roomy = pack_shards(memory, budget=100, kept=0)
    assert roomy.shards == [[0, 1, 2]] and roomy.keeps == [True] and roomy.kept_activation_bytes == 12
    assert pack_shards(memory, budget=60, kept=0).keeps == [False, True]  # all three: 3 shards, not 2
    some = pack_shards(memory, budget=36, kept=0)
    assert some.shards == [[0], [1], [2]] and some.keeps == [False, True, True] and some.kept_activation_bytes == 8
    tight = pack_shards(memory, budget=28, kept=0)
    assert tight.shards == [[0], [1], [2]] and tight.keeps == [False] * 3 and tight.kept_activation_bytes == 0
    assert pack_shards(memory, budget=100, kept=0, training=False).keeps == [False]


def test_packing_puts_a_segment_over_half_the_room_alone_without_prefetch_around_it():
    packing = pack_shards(segments((2, 0), (2, 0), (9, 0), (2, 0), (2, 0)), budget=12, kept=1)
    assert packing.shards == [[0, 1], [2], [3, 4]]
    assert packing.overlaps == [False, False]
    assert pack_shards(segments((2, 0), (2, 0), (9, 0)), budget=12, kept=1, prefetch=False).overlaps == [False]
    assert pack_shards(segments((3, 0), (5, 0), (3, 0)), budget=12, kept=1).overlaps == [True, True]


@pytest.mark.parametrize("kept", [1, 20])
def test_packing_refuses_naming_the_smallest_budgets_and_the_segment(kept):
    memory = segments((2, 1), (6, 2), (3, 0))
    with pytest.raises(
        ValueError, match=r"the segment segment 1 needs 8 B .*`memory_budget=(\d+)`.*`memory_budget=(\d+)`"
    ) as info:
        pack_shards(memory, budget=kept + 7, kept=kept)
    asked, smallest, with_prefetch = map(int, re.findall(r"`memory_budget=(\d+)`", str(info.value)))
    assert asked == kept + 7
    assert (smallest, with_prefetch) == (kept + 8, kept + 11)  # 8 beside the 3 of a neighbour
    assert pack_shards(memory, budget=smallest, kept=kept).overlaps == [False, False]
    assert pack_shards(memory, budget=with_prefetch, kept=kept).overlaps == [True, True]
    assert not all(pack_shards(memory, budget=with_prefetch - 1, kept=kept).overlaps)
    with pytest.raises(ValueError):
        pack_shards(memory, budget=smallest - 1, kept=kept)


# ------------------------------------------------------------------------------------------------ trained runs
class ForwardOps(TorchDispatchMode):
    """Counts the `tanh` of each training step: one per block's forward, more where a forward runs again."""

    def __init__(self) -> None:
        super().__init__()
        self.tanh = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.tanh.default:
            self.tanh += 1
        return func(*args, **(kwargs or {}))


class CountForwards(L.Callback):
    """The block forwards (`tanh`s) of each training batch."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._mode = ForwardOps()
        self._mode.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self._mode.__exit__(None, None, None)
        self.per_batch.append(self._mode.tanh)


def one_device_and_spilled(
    budget: str | int, spill_dir: Any = None, model: L.LightningModule | None = None, **kwargs: Any
):
    torch.manual_seed(0)
    reference = model or TinyLM(dropout=0.1, scheduler=True)
    spilled = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit(reference, "auto", **kwargs)
    torch.manual_seed(1)
    counts = CountForwards()
    strategy = SpillingStrategy(memory_budget=budget, spill_dir=spill_dir)
    trainer = fit(spilled, strategy, callbacks=[counts], **kwargs)
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(spilled, reference)
    return strategy, counts


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_the_smallest_budget_a_refusal_names_trains_like_one_device(tmp_path, disk):
    """A budget too small is refused naming the smallest that trains (each shard alone on the device) and the one
    that keeps prefetch; the first trains exactly like one device, one byte less is refused."""
    with pytest.raises(ValueError, match=r"between `cuts\.3` and the end .*The smallest budget") as info:
        fit(TinyLM(dropout=0.1), SpillingStrategy(memory_budget="20KB"))
    asked, smallest, with_prefetch = map(int, re.findall(r"`memory_budget=(\d+)`", str(info.value)))
    assert asked == 20_000  # in bytes too, as the sizes it is compared with may round alike
    strategy, _ = one_device_and_spilled(smallest, spill_dir=tmp_path if disk else None)
    assert len(strategy.shards) == 5
    with pytest.raises(ValueError, match=f"`memory_budget={smallest}`"):
        fit(TinyLM(dropout=0.1), SpillingStrategy(memory_budget=smallest - 1))
    assert smallest < with_prefetch
    assert not list(tmp_path.glob("spill-*"))


def test_a_shard_alone_on_the_device_is_logged_with_the_budget_that_prefetches_it(caplog):
    with caplog.at_level(logging.INFO):
        fit(TinyLM(), SpillingStrategy(memory_budget="55KB"), max_steps=1)
    said = " ".join(caplog.messages)
    assert re.search(r"Shards \[\d, \d\].* do not fit on the device together.*`memory_budget=\d+`", said), said


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_shards_with_room_keep_their_activations_and_train_like_one_device(tmp_path, disk):
    """With room for the activations of all but the first two of six segments, in shards of two: the first shard
    computes its forward again in backward, the others keep their activations. One device runs 6 layer forwards a
    batch; here 2 more. Dropout on: the same masks, the same losses and weights as one device."""
    probe = SpillingStrategy(memory_budget="200KB")
    fit_mlp(MLP(64, 6, dropout=0.1, lr=1e-2), probe, max_steps=1, width=64, rows=64, batch_size=16)
    memory, kept = probe.segment_memory, probe.kept_bytes
    budget = kept + 4 * max(m.need for m in memory) + sum(m.activation_bytes for m in memory[2:])
    torch.manual_seed(0)
    reference = MLP(64, 6, dropout=0.1, lr=1e-2)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    expected = fit_mlp(reference, "auto", max_steps=4, width=64, rows=64, batch_size=16, callbacks=[StepLosses()])
    torch.manual_seed(1)
    counts, strategy = CountForwards(), SpillingStrategy(memory_budget=budget, spill_dir=tmp_path if disk else None)
    trainer = fit_mlp(model, strategy, max_steps=4, width=64, rows=64, batch_size=16, callbacks=[StepLosses(), counts])
    assert strategy.shards == [[0, 1], [2, 3], [4, 5]] and strategy.recomputing_shards == [0]
    assert set(counts.per_batch) == {6 + 2}
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=0, atol=0)
    assert_same_model(model, reference)


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_a_model_without_room_to_keep_activations_recomputes_every_shard_but_the_last(tmp_path, disk):
    strategy, counts = one_device_and_spilled(BUDGETS[5], spill_dir=tmp_path if disk else None)
    assert strategy.recomputing_shards == [0, 1, 2, 3]
    assert set(counts.per_batch) == {5 + 4}


# ------------------------------------------------------------------------------------------ budget arguments
def test_a_budget_can_be_a_share_of_the_device_memory():
    assert parse_bytes("50%") == 0.5
    strategy = SpillingStrategy(memory_budget="25%")
    fit(TinyLM(), strategy, max_steps=1)
    with open("/proc/meminfo") as f:
        total = int(dict(line.split(":", 1) for line in f)["MemTotal"].split()[0]) * 1024
    assert strategy.budget_bytes == total // 4


@pytest.mark.parametrize("size", [0.5, 1.5, "150%", "0%"])
def test_a_fraction_is_not_taken_for_bytes(size):
    with pytest.raises(ValueError, match=r"'50%'|share of the device|whole number of bytes"):
        parse_bytes(size)
    if size == 0.5:
        with pytest.raises(ValueError, match=r"For a share of the device's memory write '50%'"):
            SpillingStrategy(memory_budget=size)


# ------------------------------------------------------------------------------------------------- spill_dir


# ------------------------------------------------------------------------------------ cutting around large layers
class SmallLlama(L.LightningModule):
    """A Hugging Face Llama with its LM head apart from its embedding, cut after the embedding, each decoder layer
    and the final norm, as the spilling docs show: the embedding and the head are segments of their own."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)
        inner = self.model.model
        cut_after([inner.embed_tokens, *inner.layers, inner.norm])

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        idx, y = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_large_lm_head_cut_apart_sets_the_smallest_budget_and_trains_there():
    """The refusal names the LM head's segment (after the final norm) as the one that sets the smallest budget,
    and at that budget the model trains as on one device."""
    torch.manual_seed(0)
    idx = torch.randint(0, 2048, (32, 8))
    loader = DataLoader(TensorDataset(idx, idx.roll(-1, 1)), batch_size=8)
    with pytest.raises(ValueError, match=r"the segment between `model\.model\.norm\.cutpoint` and the end") as info:
        fit(SmallLlama(), SpillingStrategy(memory_budget="10KB"), loader=loader, max_steps=2)
    smallest = int(re.findall(r"`memory_budget=(\d+)`", str(info.value))[1])
    torch.manual_seed(0)
    reference = SmallLlama()
    model = copy.deepcopy(reference)
    expected = fit(reference, "auto", loader=loader, max_steps=2, limit_val_batches=0)
    strategy = SpillingStrategy(memory_budget=smallest)
    trainer = fit(model, strategy, loader=loader, max_steps=2, limit_val_batches=0)
    assert strategy.shards[-1] == [5], strategy.shards  # the head alone
    torch.testing.assert_close(losses(trainer), losses(expected), rtol=1e-5, atol=1e-6)
    assert_same_model(model, reference)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (2048, 2048),
        (2e9, 2 * 10**9),
        ("2e9", 2 * 10**9),
        ("512MB", 512 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5 GB", 15 * 10**8),
    ],
)
def test_memory_budget_sizes(size, expected):
    assert parse_bytes(size) == expected


@pytest.mark.parametrize("size", [True, "lots", "0MB", -1, [1]])
def test_a_bad_memory_budget_is_named(size):
    with pytest.raises((TypeError, ValueError), match=r"`memory_budget="):
        parse_bytes(size)


@pytest.mark.parametrize("budget", ["lots", "12 parsecs", 0, "-1MB"])
def test_a_budget_that_is_not_a_size(budget):
    with pytest.raises(ValueError, match="memory_budget"):
        SpillingStrategy(memory_budget=budget)


def test_a_parameter_outside_the_optimizer_is_planned_without_gradient_or_state():
    """A frozen block the optimizer does not hold takes its parameters' bytes alone, not 4x (a LoRA model's base
    weights were planned as if trained, in several times the shards it needs); a trained one takes 4x."""
    model = FrozenEmbeddingLM()
    model.blocks[1].requires_grad_(False)
    trainer = fit(model, SpillingStrategy(memory_budget=BUDGETS[5]), max_steps=1)
    memory = trainer.strategy.segment_memory
    frozen, trained = (sum(4 * p.numel() for p in model.blocks[i].parameters()) for i in (1, 2))
    assert (memory[1].state_bytes, memory[2].state_bytes) == (frozen, 4 * trained)
