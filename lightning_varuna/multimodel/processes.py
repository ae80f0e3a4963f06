"""Sweeps whose steps are mostly Python (small models on the CPU): each model trained alone, by its own Trainer, in
one of D worker processes forked as the sweep starts, the most work first; what its fit leaves (weights, progress,
metrics, checkpoint paths) is sent back to this process.

In threads of one process such models cannot use D cores: a step of a few milliseconds is mostly Lightning's loop and
torch's dispatch, which hold Python's interpreter lock. A model per process gives up what threads give: a model's
turns on any free device, so that all end together."""

from __future__ import annotations

import gc
import io
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_varuna._torch_private import distributed_state
from lightning_varuna.multimodel.generator_checkpoint import GeneratorCheckpoint
from lightning_varuna.multimodel.held_loaders import draw_holding
from lightning_varuna.multimodel.member import SweepMember
from lightning_varuna.multimodel.member_callback import step_loss
from lightning_varuna.multimodel.report import ModelResult, SweepDisplay
from lightning_varuna.multimodel.scheduler import DeviceSpan, SweepStopped
from lightning_varuna.multimodel.signals import handled
from lightning_varuna.multimodel.worker_logs import WorkerLogs
from lightning_varuna.pipeline.replay import generator_states
from lightning_varuna.strategies.callback_hooks import callbacks_of
from lightning_varuna.strategies.spilling import SpillingStrategy

__all__ = [
    "WorkerCallback",
    "WorkerStrategy",
    "ended_at_exit",
    "fit_in_processes",
    "own_end",
    "picklable",
    "start_forked",
]

LOGS_PRINTED_EVERY_S = 0.2  # how often the sweep's process prints what its workers logged


class WorkerStrategy(SpillingStrategy):
    """`SpillingStrategy` of ``member`` in a worker process, where it draws from the process's generator alone: a fit
    resumed from a checkpoint starts its training DataLoaders as the uninterrupted fit did (`GeneratorCheckpoint`)."""

    def __init__(self, member: SweepMember, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._member = member

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        resumed = self._member.resumed_training(self._module.trainer)
        if isinstance(dataloader, DataLoader) and resumed is not None:
            return draw_holding(dataloader, nullcontext, resumed)
        return dataloader


class WorkerCallback(GeneratorCheckpoint):
    """In a worker process: sends the model's progress to the sweep, ends its fit at the next batch once the worker
    is told to stop (SIGTERM, Ctrl-C), and keeps its generator state (the process's) in its checkpoints."""

    def __init__(self, member: SweepMember) -> None:
        cpu = torch.device("cpu")
        super().__init__(member, cpu, partial(generator_states, cpu), nullcontext)
        self.send: Callable[[tuple[Any, ...]], None] | None = None
        self.stop = threading.Event()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._send("started", trainer.estimated_stepping_batches, trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, i)
        if self.stop.is_set():
            raise SweepStopped("the sweep was stopped (its worker process got SIGTERM or Ctrl-C)")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._send("stepped", trainer.global_step, step_loss(trainer, pl_module, outputs))

    def _send(self, *message: Any) -> None:
        if self.send is not None:
            self.send(message)


def fit_in_processes(
    members: list[SweepMember],
    results: list[ModelResult],
    devices: int,
    display: SweepDisplay | None,
    spans: list[DeviceSpan],
) -> None:
    """Fit each of ``members`` whole in one of ``devices`` forked worker processes, the most work (steps times
    parameters) first; fill in ``results`` and each model and Trainer with what its fit left, add a span per fit to
    ``spans``. SIGTERM or Ctrl-C stop the running fits at their next batch and start no other."""
    sweep = _ProcessSweep(members, results, display, spans)
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe() for _ in range(devices)]
    logs = WorkerLogs(context) if display is not None else None
    workers = [
        context.Process(target=_work, args=(pipes, k, members, logs), name=f"sweep device {k}", daemon=False)
        for k in range(devices)
    ]
    start_forked(workers)
    for _, child in pipes:
        child.close()
    connections = {parent: k for k, (parent, _) in enumerate(pipes)}

    def stop(signum: int, frame: Any) -> None:
        sweep.stopped.append(signal.Signals(signum).name)
        for worker in workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)  # type: ignore[arg-type]

    with handled((signal.SIGINT, signal.SIGTERM), stop), ended_at_exit(workers, logs):
        while connections:
            if logs is not None:
                logs.print_sent()
            timeout = LOGS_PRINTED_EVERY_S if logs is not None else None  # else a message wakes it
            for connection in cast(list[Connection], wait(list(connections), timeout=timeout)):
                try:
                    message = connection.recv()
                except EOFError:  # the worker has ended
                    worker = workers[connections.pop(connection)]
                    worker.join()
                    sweep.died(connection, worker.exitcode)
                    continue
                sweep.handle(connection, connections[connection], *message)
    sweep.end_unstarted()


class _ProcessSweep:
    """The sweep's side of its worker processes: which model each runs, and what their messages say."""

    def __init__(
        self,
        members: list[SweepMember],
        results: list[ModelResult],
        display: SweepDisplay | None,
        spans: list[DeviceSpan],
    ) -> None:
        self.members, self.results, self.display, self.spans = members, results, display, spans
        self.order = sorted(range(len(members)), key=lambda i: -_expected_work(members[i]))
        self.running: dict[Connection, tuple[int, float]] = {}
        self.stopped: list[str] = []  # the signals that stopped the sweep

    def handle(self, connection: Connection, device: int, kind: str, *args: Any) -> None:
        """A worker's message: it asks for the ``"next"`` model, or its model has ``"started"`` training, has
        ``"stepped"`` or has ``"ended"`` its fit."""
        if kind == "next":
            index = self.order.pop(0) if self.order and not self.stopped else None
            connection.send(index)
            if index is not None:
                self.running[connection] = index, time.perf_counter()
                self.results[index].status = "running"
            return
        index = self.running[connection][0]
        member = self.members[index]
        if kind == "stepped" and args[1] is not None:
            member.last_loss = args[1]
        if kind == "ended":
            start = self.running.pop(connection)[1]
            _take_back(member, self.results[index], args[0])
            self.spans.append(DeviceSpan(device, member.name, "fit", 0, start, time.perf_counter()))
        if self.display is not None:
            if kind == "started":
                self.display.started(member.name, *args)
            elif kind == "stepped":
                self.display.stepped(member.name, *args)
            else:
                self.display.ended(member.name, self.results[index].status)

    def died(self, connection: Connection, exitcode: int | None) -> None:
        """A worker ended; if it was fitting a model, that model failed."""
        if connection in self.running:
            index = self.running.pop(connection)[0]
            self.results[index].status = "failed"
            self.results[index].error = RuntimeError(
                f"The worker process fitting {self.members[index].name} died (exit code {exitcode}) during its fit."
            )

    def end_unstarted(self) -> None:
        """The models never started (the sweep was stopped) end stopped."""
        for index in self.order:
            self.results[index].status = "stopped"
            reason = self.stopped[0] if self.stopped else "its worker processes ended"
            self.results[index].error = SweepStopped(f"the sweep was stopped ({reason}) before this model started")


def _expected_work(member: SweepMember) -> float:
    """How long a model's fit is expected to take, to order them: its steps (unknown: the longest) times its size."""
    steps = member.trainer.max_steps if member.trainer.max_steps > 0 else math.inf
    return steps * sum(p.numel() for p in member.model.parameters())


def _work(
    pipes: list[tuple[Connection, Connection]], device: int, members: list[SweepMember], logs: WorkerLogs | None
) -> None:
    """Worker process ``device``: fit the model the sweep names next, alone on one thread, until it names none; its
    log lines and warnings go to ``logs`` where given (the sweep's display prints them)."""
    connection = own_end(pipes, device)
    if logs is not None:
        logs.send_from_here()
    torch.set_num_threads(1)
    callbacks = [_worker_callback(member.trainer) for member in members]

    def stop(signum: int, frame: Any) -> None:
        for callback in callbacks:
            callback.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        connection.send(("next",))
        index = connection.recv()
        if index is None:
            return
        callbacks[index].send = connection.send
        connection.send(("ended", _fit_alone(members[index])))


def _fit_alone(member: SweepMember) -> bytes:
    """Fit ``member``; what it left, serialized for the sweep's process (`_take_back`)."""
    trainer, model = member.trainer, member.model
    start, status, steps_before = time.perf_counter(), "finished", trainer.global_step
    error: BaseException | None = None
    torch.set_rng_state(member.random_state[0])  # as it was when the model was added (workers run on the CPU)
    try:
        trainer.fit(model, **member.fit_kwargs)
    except (SweepStopped, SIGTERMException) as stopped:  # Lightning's own SIGTERM handler raises the latter
        status, error = "stopped", SweepStopped(f"the sweep was stopped ({type(stopped).__name__})")
    except BaseException as failure:  # noqa: BLE001 - one model's failure must not end the sweep
        status, error = "failed", failure
    left = {
        "status": status,
        "error": picklable(error),
        "seconds": time.perf_counter() - start,
        "steps": trainer.global_step - steps_before,
        "model": model.state_dict(),
        "fit_loop": trainer.fit_loop.state_dict(),
        "state": trainer.state,
        "should_stop": trainer.should_stop,
        "metrics": {name: getattr(trainer, name) for name in _METRICS},
        "checkpoints": [(c.dirpath, c.state_dict()) for c in callbacks_of(trainer, ModelCheckpoint)],
    }
    buffer = io.BytesIO()
    torch.save(left, buffer)
    return buffer.getvalue()


def _take_back(member: SweepMember, result: ModelResult, serialized: bytes) -> None:
    """Load what ``member``'s fit left in its worker into its model and Trainer here."""
    left = torch.load(io.BytesIO(serialized), weights_only=False)
    trainer = member.trainer
    member.model.load_state_dict(left["model"])
    trainer.fit_loop.load_state_dict(left["fit_loop"])
    trainer.state, trainer.should_stop = left["state"], left["should_stop"]
    for name, metrics in left["metrics"].items():
        getattr(trainer, name).update(metrics)
    for callback, (dirpath, state) in zip(callbacks_of(trainer, ModelCheckpoint), left["checkpoints"]):
        callback.dirpath = dirpath
        callback.load_state_dict(state)
    result.status, result.error, result.steps = left["status"], left["error"], left["steps"]
    result.seconds = result.device_s = left["seconds"]
    result.final_loss = member.last_loss


# A Trainer's metrics: outside a run, each property returns the dict it keeps (`_lightning_private.py`).
_METRICS = ("callback_metrics", "logged_metrics", "progress_bar_metrics")


def _worker_callback(trainer: pl.Trainer) -> WorkerCallback:
    return callbacks_of(trainer, WorkerCallback)[0]


def picklable(error: BaseException | None) -> BaseException | None:
    """``error``, or a RuntimeError with its message and traceback where it cannot be sent to another process."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - whatever the exception holds
        trace = "".join(traceback.format_exception(error))
        return RuntimeError(f"{type(error).__name__}: {error}\n{trace}")


def start_forked(workers: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Start forked ``workers`` with the objects made so far (the libraries', the models') frozen out of the garbage
    collector: each worker's collector would go over them all and copy every page it touched out of the memory the
    worker shares with this process (on `benchmarks/model_selection.py`, the trials took 6% longer for it)."""
    gc.freeze()
    try:
        for worker in workers:
            worker.start()
    finally:
        gc.unfreeze()


def own_end(pipes: list[tuple[Connection, Connection]], k: int) -> Connection:
    """In forked worker ``k``: its end of its pipe to the calling process (the second); every other end it inherited
    is closed, so that each worker's pipe reads as closed in the calling process once that worker has ended. The
    worker also drops the torch.distributed process group it may have inherited (`distributed_state`): its models
    train alone."""
    if dist.is_available() and dist.is_initialized():
        distributed_state.default_pg = None
    own = pipes[k][1]
    for end in (end for pipe in pipes for end in pipe if end is not own):
        end.close()
    return own


@contextmanager
def ended_at_exit(
    workers: Sequence[multiprocessing.process.BaseProcess], logs: WorkerLogs | None = None
) -> Iterator[None]:
    """Wait for the workers as the block ends, printing the ``logs`` they send meanwhile (a worker ends once what it
    sent is read); if the block raised, kill them first (none is left waiting for a model)."""
    try:
        yield
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    finally:
        for worker in workers:
            while worker.exitcode is None:
                worker.join(LOGS_PRINTED_EVERY_S)
                if logs is not None:
                    logs.print_sent()
        if logs is not None:
            logs.print_sent()
