"""Split a batch into micro-batches along dim 0 and merge per-micro-batch results back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

__all__ = [
    "MICROBATCHES_PER_STAGE",
    "batch_size_of",
    "default_micro_batch_size",
    "first_rows",
    "has_ignored_labels",
    "merge_microbatches",
    "microbatch_sizes",
    "per_sample_items",
    "split_microbatches",
    "unsplit_leaves",
]

# Micro-batches per pipeline stage when the user does not choose a micro-batch size: with M = 4 x P micro-batches
# the 1F1B / GPipe bubble, (P - 1) / (M + P - 1), stays under 20%, while micro-batches stay as large as that allows.
MICROBATCHES_PER_STAGE = 4


def batch_size_of(batch: Any) -> int:
    """Dim 0 of the first tensor in ``batch``."""
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise TypeError("The batch holds no tensor with a batch dimension; cannot split it into micro-batches.")


def has_ignored_labels(batch: Any) -> bool:
    """Whether ``batch`` is a mapping whose ``"labels"`` tensor holds -100, Hugging Face's (and cross-entropy's) mark
    of a token without a label: a loss that is a mean over the labelled tokens then differs from a mean over rows."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return isinstance(labels, Tensor) and bool((labels == -100).any())


def microbatch_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    """Sizes of the micro-batches: all ``micro_batch_size`` but a smaller last one if it doesn't divide. A last one
    of a single row takes a row from the one before (``[3, 2]``, not ``[4, 1]``), or joins it at two rows each
    (``[2, 3]``, not ``[2, 2, 1]``): BatchNorm cannot train on one row, and one-device training never had such a
    batch."""
    if micro_batch_size < 1:
        raise ValueError(f"`micro_batch_size={micro_batch_size}` must be a positive integer.")
    count = math.ceil(batch_size / micro_batch_size)
    sizes = [min(micro_batch_size, batch_size - i * micro_batch_size) for i in range(count)]
    if count > 1 and sizes[-1] == 1 and micro_batch_size >= 2:
        sizes[-2:] = [micro_batch_size - 1, 2] if micro_batch_size > 2 else [3]
    return sizes


def default_micro_batch_size(batch_size: int, num_stages: int, min_rows: int = 1) -> int:
    """Rows per micro-batch that split a batch into ``MICROBATCHES_PER_STAGE`` micro-batches per stage, at least
    ``min_rows`` (2 for BatchNorm, which cannot train on one row).

    One stage needs no micro-batches: the whole batch is one (as fast as the model allows).
    """
    if num_stages == 1:
        return max(batch_size, 1)
    return max(min_rows, math.ceil(batch_size / (MICROBATCHES_PER_STAGE * num_stages)))


def split_microbatches(batch: Any, micro_batch_size: int) -> list[Any]:
    """Slice every tensor whose dim 0 is the batch size; other leaves are shared by all micro-batches."""
    size = batch_size_of(batch)
    leaves, spec = tree_flatten(batch)
    chunks = []
    start = 0
    for n in microbatch_sizes(size, micro_batch_size):
        chunks.append(tree_unflatten(_rows(leaves, size, start, n), spec))
        start += n
    return chunks


def unsplit_leaves(batch: Any) -> list[str]:
    """Where ``batch`` holds tensors with rows that `split_microbatches` gives whole to every micro-batch (their dim 0
    is not the batch size), as ``[1]`` or ``['mask']``."""
    size = batch_size_of(batch)
    leaves, _ = tree_flatten_with_path(batch)
    return [
        keystr(path) for path, leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] != size
    ]


def per_sample_items(batch: Any, samples: int) -> str | None:
    """Where ``batch`` holds (within it, not as its own fields) a list or tuple of ``samples`` items alike, tensors of
    one dtype and number of dims or dicts (one per sample, as a detection model's images and targets, rather than
    rows of a tensor), as ``[0]``; None where it holds none."""

    def alike(items: list | tuple) -> bool:
        if all(isinstance(item, Mapping) for item in items):
            return True
        kinds = {(item.dtype, item.dim()) if isinstance(item, Tensor) else None for item in items}
        return None not in kinds and len(kinds) == 1

    def find(node: Any, path: str) -> str | None:
        if isinstance(node, Mapping):
            children = [(f"[{key!r}]", child) for key, child in node.items()]
        elif isinstance(node, (list, tuple)):
            if path and len(node) == samples and alike(node):  # within the batch: the batch's own fields are not
                return path
            children = [(f"[{i}]", child) for i, child in enumerate(node)]
        else:
            return None
        return next((found for key, child in children if (found := find(child, path + key)) is not None), None)

    return find(batch, "")


def first_rows(batch: Any, rows: int) -> Any:
    """The first micro-batch of ``rows`` rows of ``batch`` (without slicing the others)."""
    size = batch_size_of(batch)
    leaves, spec = tree_flatten(batch)
    return tree_unflatten(_rows(leaves, size, 0, min(rows, size)), spec)


def _rows(leaves: list[Any], size: int, start: int, count: int) -> list[Any]:
    """Rows ``start:start + count`` of the tensor leaves whose dim 0 is the batch (``size``); other leaves as is."""
    return [
        leaf[start : start + count] if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == size else leaf
        for leaf in leaves
    ]


def merge_microbatches(outputs: list[Any], weights: list[float]) -> Any:
    """Merge per-micro-batch step outputs leaf by leaf into the batch's.

    Tensors with rows are concatenated along dim 0. A 0-dim floating-point tensor or a float (a mean: a loss, an
    accuracy) becomes the ``weights``-weighted sum, the batch's mean when the weights are the micro-batch sizes over
    the batch size (a float all micro-batches agree on is kept as it is); a 0-dim integer tensor or an int (a count:
    rows, correct predictions) becomes the sum; a bool (a flag) is true where any micro-batch's is; anything else (a
    string) is the first micro-batch's.
    """
    if all(o is None for o in outputs):
        return None
    flat = [tree_flatten(o) for o in outputs]
    merged = [_merged_leaf(parts, weights) for parts in zip(*(leaves for leaves, _ in flat))]
    return tree_unflatten(merged, flat[0][1])


def _merged_leaf(parts: tuple[Any, ...], weights: list[float]) -> Any:
    first = parts[0]
    if isinstance(first, Tensor):
        parts = tuple(p.detach() for p in parts)
        if first.dim() > 0:
            return torch.cat(parts)
        if first.is_floating_point() or first.is_complex():
            return sum(w * p for w, p in zip(weights, parts))
        return torch.stack(parts).any() if first.dtype == torch.bool else torch.stack(parts).sum()
    if isinstance(first, bool):
        return any(parts)
    if isinstance(first, int):
        return sum(parts)
    if isinstance(first, float) and any(p != first for p in parts):
        return sum(w * p for w, p in zip(weights, parts))
    return first
