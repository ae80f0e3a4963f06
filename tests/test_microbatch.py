"""Splitting a batch into micro-batches along dim 0, merging per-micro-batch outputs back, and combining what the
micro-batch steps log."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy

from lightning_varuna.data.microbatch import (
    batch_size_of,
    default_micro_batch_size,
    first_rows,
    merge_microbatches,
    microbatch_sizes,
    split_microbatches,
    unsplit_leaves,
)
from lightning_varuna.pipeline.module_hooks import differing_names, merge_stage_logs
from lightning_varuna.pipeline.step_logging import LogRecorder


@pytest.mark.parametrize(
    ("batch_size", "micro_batch_size", "expected"),
    [
        (8, 4, [4, 4]),
        (10, 4, [4, 4, 2]),
        (7, 3, [3, 2, 2]),  # a last micro-batch of one row takes one from the one before (BatchNorm)
        (5, 4, [3, 2]),
        (5, 2, [2, 3]),  # or joins it, at two rows each
        (3, 8, [3]),
        (5, 1, [1, 1, 1, 1, 1]),
        (6, 6, [6]),
    ],
)
def test_microbatch_sizes(batch_size, micro_batch_size, expected):
    sizes = microbatch_sizes(batch_size, micro_batch_size)
    assert sizes == expected
    assert sum(sizes) == batch_size


def test_batch_size_of():
    assert batch_size_of((torch.zeros(5, 2), torch.zeros(3))) == 5
    # Non-tensor leaves and 0-dim tensors are skipped.
    assert batch_size_of({"name": "x", "scale": torch.tensor(2.0), "x": torch.zeros(7, 1)}) == 7
    with pytest.raises(TypeError, match="no tensor with a batch dimension"):
        batch_size_of({"a": torch.tensor(1.0), "b": 3})


def test_split_tuple_of_tensors_with_smaller_last_microbatch():
    x = torch.arange(30.0).reshape(10, 3)
    y = torch.arange(10)
    chunks = split_microbatches((x, y), 4)
    assert len(chunks) == 3
    assert [c[0].shape[0] for c in chunks] == [4, 4, 2]
    for i, (cx, cy) in enumerate(chunks):
        assert isinstance((cx, cy), tuple)
        torch.testing.assert_close(cx, x[4 * i : 4 * i + 4])
        torch.testing.assert_close(cy, y[4 * i : 4 * i + 4])
    torch.testing.assert_close(torch.cat([c[0] for c in chunks]), x)
    torch.testing.assert_close(torch.cat([c[1] for c in chunks]), y)


def test_split_dict_keeps_non_batch_leaves_whole():
    x = torch.randn(10, 3)
    mask = torch.randn(10)
    table = torch.randn(4, 2)  # dim 0 is not the batch: shared by every micro-batch
    scale = torch.tensor(0.5)
    batch = {"x": x, "extra": {"mask": mask, "table": table}, "scale": scale, "tag": "train"}
    chunks = split_microbatches(batch, 4)
    assert [c["x"].shape[0] for c in chunks] == [4, 4, 2]
    for i, chunk in enumerate(chunks):
        assert set(chunk) == {"x", "extra", "scale", "tag"}
        torch.testing.assert_close(chunk["x"], x[4 * i : 4 * i + 4])
        torch.testing.assert_close(chunk["extra"]["mask"], mask[4 * i : 4 * i + 4])
        assert chunk["extra"]["table"] is table
        assert chunk["scale"] is scale
        assert chunk["tag"] == "train"
    assert unsplit_leaves(batch) == ["['extra']['table']"]


@pytest.mark.parametrize("rows", [1, 2, 10, 20])
def test_first_rows_is_the_first_micro_batch(rows):
    x, mask, table = torch.randn(10, 3), torch.randn(10), torch.randn(4, 2)
    batch = {"x": x, "extra": {"mask": mask, "table": table}, "tag": "train"}
    first, expected = first_rows(batch, rows), split_microbatches(batch, rows)[0]
    torch.testing.assert_close(first["x"], expected["x"])
    torch.testing.assert_close(first["extra"]["mask"], expected["extra"]["mask"])
    assert first["x"].shape[0] == min(rows, 10)
    assert first["extra"]["table"] is table and first["tag"] == "train"


def test_split_with_micro_batch_larger_than_batch_gives_one_chunk():
    x = torch.randn(3, 2)
    (only,) = split_microbatches([x], 8)
    torch.testing.assert_close(only[0], x)


def test_merge_weighted_mean_equals_full_batch_mean():
    torch.manual_seed(0)
    x = torch.randn(10, 3)
    target = torch.randn(10, 3)
    chunks = split_microbatches((x, target), 4)
    sizes = microbatch_sizes(10, 4)
    outputs = [torch.nn.functional.mse_loss(cx, ct) for cx, ct in chunks]  # mean-reduced
    merged = merge_microbatches(outputs, [n / 10 for n in sizes])
    assert merged.dim() == 0
    torch.testing.assert_close(merged, torch.nn.functional.mse_loss(x, target))


def test_merge_detaches_and_handles_nested_outputs():
    torch.manual_seed(0)
    x = torch.randn(7, 2, requires_grad=True)
    chunks = split_microbatches((x,), 3)
    sizes = microbatch_sizes(7, 3)
    outputs = [{"loss": c[0].mean(), "pred": c[0] * 2, "name": f"mb{i}"} for i, c in enumerate(chunks)]
    merged = merge_microbatches(outputs, [n / 7 for n in sizes])
    torch.testing.assert_close(merged["loss"], x.mean().detach())
    torch.testing.assert_close(merged["pred"], (x * 2).detach())
    assert not merged["loss"].requires_grad
    assert not merged["pred"].requires_grad
    assert merged["name"] == "mb0"  # non-tensor leaves come from the first micro-batch


def test_merge_sums_counts_and_averages_means():
    """What a step returns besides its loss, as on one device: counts (ints, integer tensors) add up over the
    micro-batches, means (floats, float tensors) are weighted by the micro-batch sizes, a flag is any micro-batch's."""
    x = torch.arange(10.0)
    sizes = microbatch_sizes(10, 4)  # [4, 4, 2]
    outputs = [
        {
            **{"rows": len(c), "above": (c > 4).sum(), "mean": c.mean(), "mean_number": c.mean().item(), "lr": 0.1},
            **{"has_nine": (c == 9).any(), "has_zero": bool((c == 0).any()), "name": "step"},
        }
        for (c,) in split_microbatches((x,), 4)
    ]
    merged = merge_microbatches(outputs, [n / 10 for n in sizes])
    assert merged["rows"] == 10
    assert merged["above"].item() == 5 and merged["above"].dtype == torch.long
    torch.testing.assert_close(merged["mean"], x.mean())
    assert merged["mean_number"] == pytest.approx(x.mean().item())
    assert merged["lr"] == 0.1  # the same in every micro-batch: kept as it is
    assert merged["has_nine"].item() is True and merged["has_zero"] is True  # flags: any micro-batch's
    assert merged["name"] == "step"


def test_split_then_merge_round_trips():
    torch.manual_seed(0)
    batch = {"ids": torch.randint(0, 9, (11, 5)), "y": torch.randn(11), "meta": "m"}
    chunks = split_microbatches(batch, 4)
    sizes = microbatch_sizes(11, 4)
    merged = merge_microbatches(chunks, [n / 11 for n in sizes])
    assert set(merged) == {"ids", "y", "meta"}
    torch.testing.assert_close(merged["ids"], batch["ids"])
    torch.testing.assert_close(merged["y"], batch["y"])
    assert merged["meta"] == "m"


def test_merge_of_all_none_is_none():
    assert merge_microbatches([None, None], [0.5, 0.5]) is None


@pytest.mark.parametrize(
    ("batch_size", "num_stages", "expected_microbatches"),
    [(32, 1, 1), (32, 2, 8), (30, 2, 8), (6, 2, 6), (3, 4, 3), (64, 4, 16)],
)
def test_default_micro_batch_size_gives_four_microbatches_per_stage(batch_size, num_stages, expected_microbatches):
    micro_batch_size = default_micro_batch_size(batch_size, num_stages)
    assert len(microbatch_sizes(batch_size, micro_batch_size)) == expected_microbatches


@pytest.mark.parametrize("batch_size", [2, 3, 6, 8, 9])
def test_the_default_for_batch_norm_never_makes_a_micro_batch_of_one_row(batch_size):
    micro_batch_size = default_micro_batch_size(batch_size, num_stages=2, min_rows=2)
    assert min(microbatch_sizes(batch_size, micro_batch_size)) >= 2


def test_logged_values_combine_over_micro_batches_as_their_reduce_fx():
    """A step logs once per micro-batch: a mean is weighted by rows, a sum (a count of rows) adds up, a max or min
    takes the largest or smallest, so that the batch's values are what one device logs for the whole batch."""
    recorder, module = LogRecorder(), L.LightningModule()
    with recorder.capture(module):
        for rows, loss, peak in ((3, 1.0, 0.2), (1, 5.0, 0.9)):
            recorder.weight = rows / 4
            module.log("loss", torch.tensor(loss))
            module.log("rows", float(rows), reduce_fx="sum")
            module.log("peak", peak, reduce_fx="max")
            module.log("low", peak, reduce_fx=torch.min)
    values = {name: value for name, value, _ in recorder.summary()}
    assert values == pytest.approx({"loss": 2.0, "rows": 4.0, "peak": 0.9, "low": 0.2})


def test_a_batch_size_the_step_passes_is_logged_as_the_batch_s():
    """``self.log(..., batch_size=len(x))`` in each micro-batch's step: the batch's value is logged with the batch's
    size, its micro-batches' sum, which weights it in the epoch's mean as on one device (the first micro-batch's
    weighed batches of other sizes alike)."""
    recorder, module = LogRecorder(training=False), L.LightningModule()
    with recorder.capture(module):
        for rows in (2, 2, 1):
            recorder.weight = rows / 5
            module.log("val_loss", torch.tensor(float(rows)), batch_size=rows)
            module.log("inferred", torch.tensor(1.0))
    logged = {name: (value, kwargs) for name, value, kwargs in recorder.summary()}
    assert logged["val_loss"] == (pytest.approx(9 / 5), {"batch_size": 5})
    assert logged["inferred"][1] == {}  # Lightning infers the whole batch's size


def test_a_value_a_metric_s_forward_returned_is_the_metric_over_the_whole_batch():
    """``self.log("acc", self.acc(preds, y))``, torchmetrics' own pattern, in each micro-batch's step: the batch's
    value is the metric over the batch (a macro accuracy is not a mean of the micro-batches'), as one device logs."""
    preds, target = torch.tensor([0, 1, 1, 2, 2, 0]), torch.tensor([0, 1, 2, 2, 1, 1])
    whole = MulticlassAccuracy(num_classes=3)(preds, target).item()
    module = L.LightningModule()
    module.acc = MulticlassAccuracy(num_classes=3)
    recorder = LogRecorder(training=False)
    with recorder.capture(module):
        for rows in (slice(0, 3), slice(3, 6)):
            recorder.weight = 0.5
            module.log("acc", module.acc(preds[rows], target[rows]))
    [(_, value, _)] = recorder.summary()
    assert value == pytest.approx(whole) and whole != pytest.approx(0.5)  # 0.5: the micro-batches' 2/3 and 1/3


def test_a_float64_value_is_logged_to_its_last_digit():
    """Under ``precision="64-true"`` a step logs float64 tensors: the batch's value keeps every digit, as one device
    logs it (before, each was rounded to float32)."""
    recorder, module = LogRecorder(), L.LightningModule()
    third = torch.tensor(1 / 3, dtype=torch.float64)
    with recorder.capture(module):
        for _ in range(2):
            recorder.weight = 0.5
            module.log("loss", third)
    [(_, value, _)] = recorder.summary()
    assert value == float(third)


def test_values_the_stages_log_merge_into_one_device_values():
    """Names one stage logs keep its value; Lightning's `grad_norm` totals combine as norms of all the stages'
    gradients; another name logged on several stages is the last stage's."""
    first = [("grad_2.0_norm_total", 3.0, {}), ("grad_inf_norm_total", 5.0, {}), ("lr", 0.1, {}), ("a", 1.0, {})]
    last = [("grad_2.0_norm_total", 4.0, {}), ("grad_inf_norm_total", 2.0, {}), ("lr", 0.2, {}), ("b", 7.0, {})]
    merged = {name: value for name, value, _ in merge_stage_logs([first, last])}
    assert merged == pytest.approx(
        {"grad_2.0_norm_total": 5.0, "grad_inf_norm_total": 5.0, "lr": 0.2, "a": 1.0, "b": 7.0}
    )
    assert differing_names([first, last]) == {"lr"}  # a warning names it


def test_a_weight_tied_across_stages_counts_once_in_the_gradient_norm_total():
    """Each stage holding a tied weight logs its norm (of the gradient summed over the stages), and its total
    includes it: the merged total counts it once, as one device's `grad_norm` over the module's parameters."""
    first = [("grad_2.0_norm/tok.weight", 3.0, {}), ("grad_2.0_norm/a", 4.0, {}), ("grad_2.0_norm_total", 5.0, {})]
    last = [("grad_2.0_norm/tok.weight", 3.0, {}), ("grad_2.0_norm/b", 12.0, {})]
    last.append(("grad_2.0_norm_total", (3.0**2 + 12.0**2) ** 0.5, {}))
    merged = {name: value for name, value, _ in merge_stage_logs([first, last])}
    assert merged["grad_2.0_norm_total"] == pytest.approx(13.0)  # sqrt(3² + 4² + 12²)
    assert merged["grad_2.0_norm/tok.weight"] == 3.0
