"""`MultiProcessStrategy`: a Lightning strategy of one process per device, in one default process group, and the
collectives that Lightning and user code call among them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

from lightning_varuna.pipeline.user_collectives import UserCollectives
from lightning_varuna.strategies.launchers import MultiProcessingLauncher, SubprocessScriptLauncher
from lightning_varuna.strategies.process_groups import choose_backend, init_process_group, torchrun_layout

__all__ = ["MultiProcessStrategy"]


class MultiProcessStrategy(ParallelStrategy):
    """One process per device, started by Lightning (a subprocess per device with ``start_method="popen"``, else
    spawned or forked), by torchrun (elastic: the processes per node and the node count follow torchrun, whatever
    the Trainer's ``devices`` and ``num_nodes`` say) or by SLURM; `setup_environment` starts the job's default
    process group. It owns the processes, not what runs in them (`VarunaStrategy`'s pipeline), whose layout says
    which of them a collective of user code runs over (``_collectives``: all of them until a subclass lays them out).
    """

    def __init__(
        self,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        check_world_size: Callable[[int], None] | None = None,
        **kwargs: Any,
    ) -> None:
        """``check_world_size``: raises if the job cannot run at a world size, called before any process starts;
        ``kwargs``: `ParallelStrategy`'s (``accelerator``, ``parallel_devices``, ``cluster_environment``...)."""
        super().__init__(**kwargs)
        self._process_group_backend, self._timeout, self._start_method = process_group_backend, timeout, start_method
        self._check_world_size = check_world_size
        self._num_nodes = 1
        self._collectives = UserCollectives()

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None and self.parallel_devices is not None
        layout = torchrun_layout(self.cluster_environment, self.parallel_devices)
        if layout is not None:
            self.parallel_devices, self.num_nodes = layout
        if self._check_world_size is not None:
            self._check_world_size(self.num_processes * self.num_nodes)
        if self._start_method == "popen":
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Set this process's global rank and the world size, then start the job's default process group. Unlike
        Lightning's DDP, the random generators are not seeded again: they stay as the script left them (or as the
        launching process had them, which Lightning's spawn launcher gives each process), as on one device."""
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        assert self.parallel_devices is not None
        self._process_group_backend = choose_backend(
            self._process_group_backend, self.parallel_devices, self.root_device
        )
        init_process_group(self.cluster_environment, self._process_group_backend, self.root_device, self._timeout)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._collectives.barrier()

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, self._collectives.group(group), sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collectives.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return self._collectives.reduce(tensor, group, reduce_op)
