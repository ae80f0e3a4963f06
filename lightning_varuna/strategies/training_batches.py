"""What `VarunaStrategy` checks of the training batches a replica receives, as each step begins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import IterableDataset

from lightning_varuna.data.microbatch import batch_size_of, has_ignored_labels
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.strategies.one_batch import check_stages_read_one_batch

__all__ = ["TrainingBatches"]


class TrainingBatches:
    """The training batches of this rank's replica: each no smaller than a micro-batch; the first of a fit read by
    every stage of the replica alike (`one_batch`) and warned about if its labels ignore tokens that ``loss_items``
    does not count; the largest sets the run's global batch (a short last batch does not), which is compared with
    that of the checkpoint the run resumed from.

    Args:
        loss_items: `VarunaStrategy`'s ``loss_items``.
    """

    def __init__(self, loss_items: Callable[[Any], int | Tensor] | None) -> None:
        self.largest: int | None = None  # rows of the largest batch so far
        self._loss_items = loss_items
        self._first_of_fit = True
        self._resumed_shape: dict[str, Any] | None = None  # of the checkpoint resumed from, until the first batch

    def fit_started(self, first: Any | None) -> None:
        """The next batch is the first of a fit, whose loop's first batch set-up read as ``first`` (None: it read
        none): a whole batch of the loader, where a fit resumed just before an epoch's short last batch begins with
        that one."""
        self._first_of_fit = True
        if first is not None:
            self.largest = max(self.largest or 0, batch_size_of(first))

    def resumed(self, shape: dict[str, Any] | None) -> None:
        """The run resumes from a checkpoint of run ``shape`` (`run_shape`; None: a plain Lightning checkpoint)."""
        self._resumed_shape = shape

    def global_batch_size(self, replicas: int) -> int | None:
        """The run's global batch over ``replicas``: its largest batch's rows on each (None before any batch)."""
        return None if self.largest is None else self.largest * replicas

    def check(
        self,
        batch: Any,
        micro_batch_size: int,
        topology: Topology,
        stages: dist.ProcessGroup | None,
        device: torch.device,
        trainer: pl.Trainer,
    ) -> int:
        """Check ``batch`` (of ``trainer``'s training loader, on ``device``), over the ``stages`` of the replica for
        the first batch of a fit; return its rows."""
        rows = batch_size_of(batch)
        self._check_micro_batch_size(rows, micro_batch_size)
        self._check_global_batch(rows, topology.data_parallel_size)
        if self._first_of_fit:  # (`one_batch`, and ignored labels)
            self._first_of_fit = False
            if self._loss_items is None and rows > micro_batch_size and has_ignored_labels(batch):
                rank_zero_warn(
                    'The batch\'s "labels" hold -100 (tokens without a label): if the loss is a mean over the '
                    "labelled tokens, micro-batches counted by rows do not train on the batch's mean; pass "
                    '`VarunaStrategy(loss_items=lambda batch: (batch["labels"] != -100).sum())` (for a causal LM, '
                    'which predicts each next token: `batch["labels"][:, 1:]`).'
                )
            loader = trainer.train_dataloader
            if isinstance(getattr(loader, "dataset", None), IterableDataset) and topology.pipeline_parallel_size > 1:
                check_stages_read_one_batch(batch, stages, topology.pipeline_parallel_size, device)
        return rows

    def _check_micro_batch_size(self, rows: int, micro_batch_size: int) -> None:
        # Against the largest batch seen: a short last batch is simply one smaller micro-batch.
        rows = max(rows, self.largest or 0)
        if micro_batch_size > rows:
            raise ValueError(
                f"`VarunaStrategy(micro_batch_size={micro_batch_size})` is larger than the batch of {rows} rows; "
                f"use micro_batch_size <= {rows} or a larger DataLoader batch_size."
            )

    def _check_global_batch(self, rows: int, replicas: int) -> None:
        self.largest = max(self.largest or 0, rows)
        if self._resumed_shape is None:
            return
        before, self._resumed_shape = self._resumed_shape.get("global_batch_size"), None
        now = self.largest * replicas
        if before is not None and before != now:
            rank_zero_warn(
                f"Resumed from a checkpoint trained with a global batch of {before} rows; this run's is {now} "
                f"(DataLoader batch {self.largest} x data_parallel_size {replicas}). Set the DataLoader batch to "
                f"{before} / data_parallel_size to continue the same training."
            )
