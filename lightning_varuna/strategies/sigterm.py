"""SIGTERM under VarunaStrategy reaches the other ranks through the job's failure notice, not through Lightning's
broadcast before every training batch.

Lightning broadcasts a SIGTERM flag from rank 0 to every rank before each training batch, and once more from its
SIGTERM handler, so that a signal that reached rank 0 alone stops every rank. That broadcast makes every batch
start at the same moment on every rank, while the stages of a pipeline run apart by design: the first stage waited
for the last stage's optimizer step and Lightning's end of batch every step (4% of a GPipe step in
``benchmarks/pipeline_step.py``). A signal that reached another rank alone blocked its handler in that broadcast.

Instead, a rank that stops on SIGTERM leaves a notice (`FailureNotice`, from the strategy's ``on_exception``) and
the others stop as it did at their next wait for it: over gloo, every wait of VarunaStrategy reads the notice twice
a second (`Waiter`). Over NCCL waits do not read it, and Lightning's broadcast stays.
"""

from __future__ import annotations

import logging
from types import FrameType

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["stop_on_sigterm_without_broadcasts"]

# Lightning's signal connector's logger: "Received SIGTERM" appears where it always did.
log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")


def stop_on_sigterm_without_broadcasts(trainer: pl.Trainer) -> None:
    """Replace Lightning's SIGTERM broadcasts of ``trainer`` (call it before the trainer registers its signal
    handlers, as a strategy's ``setup`` runs): before each training batch, a rank stops if it received SIGTERM;
    Lightning's handler records the signal and passes it on to the processes its launcher started, as before."""
    connector = trainer._signal_connector

    def note_sigterm(signum: int, frame: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        launcher = trainer.strategy.launcher
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        connector.received_sigterm = True

    def stop_if_signalled() -> None:
        if trainer.received_sigterm:
            raise SIGTERMException

    connector._sigterm_notifier_fn = note_sigterm  # type: ignore[method-assign,assignment]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = stop_if_signalled  # type: ignore[method-assign]
