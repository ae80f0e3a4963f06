"""`MorphCallback`: checkpoint and stop when the job has to change size, so that it can restart on the new set.

A job on preemptible machines learns that it must change size in three ways: a signal (SIGUSR1 by default:
a scheduler's or the user's "stop now, please"), a change in the file listing the machines available to it
(Varuna's machine list), or a preemption notice that the user's own code receives (``request``). In every case
the signal handler or the notice only records the request; at the next optimizer step (the batches of a step that
accumulates several hold gradients that no checkpoint keeps) all ranks agree on it with one collective, write an
on-demand checkpoint to ``dirpath`` together, and stop cleanly: ``fit`` returns
and the process exits with code 0, which tells the launcher that the job morphed rather than crashed. The
relaunch at the new size resumes from it with ``trainer.fit(model, ckpt_path="last")``.

Under SLURM (with Lightning's auto-requeue, its default there), a morph that SLURM's requeue signal asked for
also requeues the job, and the requeued job resumes from the checkpoint on its own. VarunaStrategy adds a
MorphCallback for that signal itself when the trainer has none (see `lightning_varuna.strategies.launchers`).
"""

from __future__ import annotations

import logging
import os
import signal as signals
import socket
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_varuna.callbacks.optimizer_steps import OptimizerSteps
from lightning_varuna.slurm import requeue_job, requeue_signal
from lightning_varuna.storage import Storage, join

__all__ = ["MorphCallback"]

log = logging.getLogger(__name__)


class MorphCallback(Callback):
    """Write a checkpoint to ``dirpath`` and stop training when the job has to change size.

    Args:
        dirpath: folder (any fsspec URL) for the on-demand checkpoints; ``ckpt_path="last"`` looks there too.
        signal: the signal(s) that request a morph, handled by this callback alone while training runs (it
            replaces Lightning's handlers for them: its SLURM requeue handler on SIGUSR1, its stop-without-
            checkpoint on SIGTERM). The handler only records the request, so a signal that arrives during a
            checkpoint write does not disturb it. Add ``signal.SIGTERM`` under ``torchrun``: its agent stops
            the workers with SIGTERM (then SIGKILL after 30 s) when machines join or leave (and start it with
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that a joining machine gets in; see docs/morphing.md).
        machine_list: URL of a file naming the machines available to the job, one host name per line (blank
            lines and ``#`` comments are ignored). When the names differ from the hosts the job runs on, the
            job morphs.
        poll_interval: seconds between two reads of ``machine_list`` (by rank 0, at a batch boundary).
        storage_options: fsspec options for ``dirpath`` and ``machine_list``; default: those of the strategy.
        requeue: after a morph, requeue the SLURM job: once the checkpoint is committed, rank 0 finalizes the
            loggers and runs ``scontrol requeue``, and SLURM stops the job's processes (SIGTERM, then SIGKILL),
            as Lightning's own requeue does. Default: when SLURM's requeue signal
            (``SLURMEnvironment.requeue_signal``, SIGUSR1 by default, with Lightning's auto-requeue on) asked for
            the morph, so that a ``scancel`` (SIGTERM) does not requeue. Outside ``fit`` (validate, test,
            predict), that signal requeues the job at once, without a checkpoint.

    After a morph, ``morphed`` is True and ``reasons`` says why (on the ranks that saw the request).
    """

    def __init__(
        self,
        dirpath: str,
        signal: int | Sequence[int] = signals.SIGUSR1,
        machine_list: str | None = None,
        poll_interval: float = 10.0,
        storage_options: dict[str, Any] | None = None,
        requeue: bool | None = None,
    ) -> None:
        self.dirpath = str(dirpath)
        self.signals = [signals.Signals(s) for s in (signal if isinstance(signal, Sequence) else [signal])]
        self.machine_list = machine_list
        self.poll_interval = poll_interval
        self.storage_options = storage_options
        self.requeue = requeue
        self.reasons: list[str] = []
        self.morphed = False
        self._lock = threading.Lock()
        self._previous_handlers: dict[signals.Signals, Any] = {}
        self._running_hosts: set[str] = set()
        self._next_poll = 0.0
        self._storage: Storage | None = None
        self._requeue_signal: signals.Signals | None = None
        self._requeue_signalled = False
        self._global_zero = False
        self._steps = OptimizerSteps()

    def request(self, reason: str) -> None:
        """Ask for a morph at the next optimizer step (thread-safe; e.g. from a preemption-notice watcher)."""
        with self._lock:
            self.reasons.append(reason)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._requeue_signalled |= signum == self._requeue_signal
        self.request(f"received {signals.Signals(signum).name}")

    def _requeue_now(self, signum: int, frame: FrameType | None) -> None:
        if self._global_zero:
            requeue_job()

    # ------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.requeue and not SLURMEnvironment.detect():
            raise ValueError("`MorphCallback(requeue=True)` requeues a SLURM job; this process runs outside SLURM.")
        self._requeue_signal, self._global_zero = requeue_signal(trainer), trainer.is_global_zero
        if stage != "fit":
            # Lightning's handler would save a checkpoint wherever the pipeline is; there is nothing to resume.
            if self._requeue_signal in self.signals and self.requeue is not False:
                self._install_handlers([self._requeue_signal], self._requeue_now)
            return
        self.reasons.clear()
        self.morphed = False
        self._requeue_signalled = False
        strategy_storage = getattr(trainer.strategy, "checkpoint_storage", None)
        if self.storage_options is not None or strategy_storage is None:
            self._storage = Storage(self.storage_options)
        else:
            self._storage = strategy_storage
        if trainer.is_global_zero:
            self._storage.check_writable(self.dirpath)
        if signals.SIGTERM in self.signals and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank_zero_warn(
                "MorphCallback: torchrun's agents share their TCPStore with the workers here. With torch 2.13 a"
                " machine that joins the running job then hangs the next rendezvous: the agents already in the"
                " job keep the previous round's `MASTER_ADDR`/`MASTER_PORT`. Start torchrun with"
                " `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` on every machine."
            )
        if self.machine_list is not None:
            hosts: list[str | None] = [socket.gethostname()]
            if dist.is_available() and dist.is_initialized():
                hosts = [None] * dist.get_world_size()
                dist.all_gather_object(hosts, socket.gethostname())
            self._running_hosts = {host for host in hosts if host is not None}
        self._install_handlers(self.signals, self._on_signal)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Again, after Lightning installed its own handlers, which these replace while training runs.
        self._install_handlers(self.signals, self._on_signal)
        self._steps.started(trainer)

    def _install_handlers(self, signums: Sequence[signals.Signals], handler: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signums:
            previous = signals.signal(signum, handler)
            self._previous_handlers.setdefault(signum, previous)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signals.signal(signum, handler)
        self._previous_handlers.clear()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_handlers()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.is_global_zero:
            self._poll_machine_list()
        if not self._steps.stepped(trainer):
            return  # a batch of a step that accumulates: its gradients would be lost, so the morph waits for the step
        with self._lock:
            requested = bool(self.reasons)
        if not trainer.strategy.reduce_boolean_decision(requested, all=False):
            return
        url = join(self.dirpath, f"morph-step={trainer.global_step}.ckpt")
        rank_zero_info(f"MorphCallback: {self.reasons or 'requested on another rank'}; saving {url} and stopping.")
        started = time.perf_counter()
        trainer.save_checkpoint(url, weights_only=False)  # the full state (and no log line asking which)
        log.info(f"MorphCallback: checkpoint written in {time.perf_counter() - started:.2f} s")
        # The ModelCheckpoints would save this same step again at the end of the interrupted epoch.
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                callback._last_global_step_saved = trainer.global_step
        self.morphed = True
        trainer.should_stop = True
        requeue = self.requeue
        if requeue is None:
            requeue = trainer.strategy.reduce_boolean_decision(self._requeue_signalled, all=False)
        if requeue:
            self._requeue_job(trainer, url)

    def _requeue_job(self, trainer: pl.Trainer, checkpoint: str) -> None:
        wait_for_checkpoints = getattr(trainer.strategy, "wait_for_checkpoints", None)
        if wait_for_checkpoints is not None:
            wait_for_checkpoints()
        if trainer.is_global_zero:
            rank_zero_info("MorphCallback: checkpoint committed; requeueing the SLURM job, which stops it.")
            for logger in trainer.loggers:
                logger.finalize("finished")
            requeue_job(checkpoint)

    def _poll_machine_list(self) -> None:
        if self.machine_list is None or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + self.poll_interval
        assert self._storage is not None
        try:
            text = self._storage.read_bytes(self.machine_list).decode()
        except (OSError, TimeoutError) as err:
            rank_zero_warn(f"MorphCallback: cannot read the machine list {self.machine_list}: {err}")
            return
        available = {line.split("#")[0].strip() for line in text.splitlines()} - {""}
        if available != self._running_hosts:
            added, removed = sorted(available - self._running_hosts), sorted(self._running_hosts - available)
            self.request(f"machine list changed: added {added}, removed {removed}")
