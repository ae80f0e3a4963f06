"""What `VarunaStrategy` is asked for: its own arguments, checked once when it is made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from lightning_varuna.partition.packing import parse_bytes
from lightning_varuna.pipeline.schedules import INTERLEAVED, SCHEDULES, V_SHAPED
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.profiling.simulator import Config
from lightning_varuna.profiling.spilled import SpilledConfig
from lightning_varuna.spilling.planning import resolve_budget

__all__ = ["VarunaConfig"]

_AUTO_CHOICES = ("pipeline_parallel_size", "micro_batch_size", "schedule")


@dataclass(kw_only=True)
class VarunaConfig:
    """The arguments of `VarunaStrategy` that are its own (its docstring says what each does), as given.

    Raises:
        ValueError: a size is not a positive integer, a schedule is unknown, ``"auto"`` lacks the profile and the
            global batch it is chosen for, or ``loss_items`` is not a function.
    """

    pipeline_parallel_size: int | Literal["auto"] = 1
    """Pipeline stages, or ``"auto"``."""
    data_parallel_size: int | None = None
    """Replicas of the pipeline; None: world size / pipeline_parallel_size."""
    micro_batch_size: int | Literal["auto"] | None = None
    """Rows per micro-batch, ``"auto"``, or None: chosen from the first batch."""
    schedule: str = "1f1b"
    """A name of `SCHEDULES` or `INTERLEAVED`, or ``"auto"``."""
    stages_per_rank: int | None = None
    """Stages per rank of an interleaved schedule (None: 2, or chosen with "auto" sizes); 1 for the others."""
    shared_weights: list[tuple[str, str]] | None = None
    """Pairs of parameter names to keep identical (the second tied to the first)."""
    profile_repeats: int = 3
    """Steps timed per segment to balance the stages (without ``profile``)."""
    profile: str | None = None
    """The URL of a profile written by ``lightning-varuna profile``."""
    global_batch_size: int | None = None
    """Rows per optimizer step over all replicas; None: DataLoader batch x data_parallel_size."""
    loss_items: Callable[[Any], int | Tensor] | None = None
    """The number of items a batch's loss is the mean of, as a function of the batch; None: its rows."""
    memory_budget: int | float | str | None = None
    """What a device may hold, for ``pipeline_parallel_size="auto"``: bytes, a size (``"2GiB"``) or a share."""
    spill_dir: str | None = None
    """A folder to spill to disk in, if the auto-configuration trains spilled; None: host memory only."""
    checkpoint_tempdir: str | None = None
    """A local folder checkpoints are written to before their upload (pipelined training only)."""

    def __post_init__(self) -> None:
        sizes = {"pipeline_parallel_size": self.pipeline_parallel_size, "micro_batch_size": self.micro_batch_size}
        for name, value in sizes.items():
            if name not in self.auto and value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f'`VarunaStrategy({name}={value!r})` must be a positive integer or "auto".')
        if self.auto and (self.profile is None or self.global_batch_size is None):
            auto = ", ".join(f'{name}="auto"' for name in sorted(self.auto))
            raise ValueError(
                f"`VarunaStrategy({auto})` picks the fastest configuration from a profile of the model: pass "
                "`profile=` (written by `lightning-varuna profile`) and the `global_batch_size=` to keep."
            )
        for name in ("data_parallel_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"`VarunaStrategy({name}={value!r})` must be a positive integer.")
        if self.schedule not in SCHEDULES and self.schedule not in INTERLEAVED and self.schedule != "auto":
            names = sorted([*SCHEDULES, *INTERLEAVED])
            raise ValueError(
                f'`VarunaStrategy(schedule={self.schedule!r})` is unknown; choose one of {names} or "auto".'
            )
        self._check_stages_per_rank()
        if self.loss_items is not None and not callable(self.loss_items):
            raise ValueError(
                f"`VarunaStrategy(loss_items={self.loss_items!r})` must be a function of a batch that returns how many "
                'items its loss is the mean of, e.g. `lambda batch: (batch["labels"] != -100).sum()`.'
            )
        if self.memory_budget is not None:
            if "pipeline_parallel_size" not in self.auto:
                raise ValueError(
                    f"`VarunaStrategy(memory_budget={self.memory_budget!r})` is the budget the auto-configuration "
                    'chooses within: pass `pipeline_parallel_size="auto"` with it (and a `profile=`), or use '
                    "`SpillingStrategy(memory_budget=...)` to train spilled on one device whatever the world size."
                )
            self.memory_budget = parse_bytes(self.memory_budget)
        elif self.spill_dir is not None:
            raise ValueError(
                f"`VarunaStrategy(spill_dir={self.spill_dir!r})` is where a spilled choice spills to: it needs a "
                '`memory_budget=` (and `pipeline_parallel_size="auto"`).'
            )
        self.shared_weights = cast(list[tuple[str, str]], [tuple(pair) for pair in self.shared_weights or []])

    def _check_stages_per_rank(self) -> None:
        """Resolve ``stages_per_rank`` (2 for an interleaved schedule, else 1) and refuse what does not go with it."""
        given = self.stages_per_rank
        if self.schedule not in INTERLEAVED:
            if given not in (None, 1):
                raise ValueError(
                    f"`VarunaStrategy(stages_per_rank={given!r})` needs an interleaved schedule: the schedule "
                    f'{self.schedule!r} runs one stage per rank. Pass `schedule="interleaved-1f1b"` too, or leave '
                    "`stages_per_rank` unset."
                )
            self.stages_per_rank = 1
            return
        if given is not None and (not isinstance(given, int) or given < 2):
            raise ValueError(
                f"`VarunaStrategy(schedule={self.schedule!r}, stages_per_rank={given!r})` interleaves 2 or more stages "
                'per rank; for one stage per rank use `schedule="1f1b"`.'
            )
        if self.schedule in V_SHAPED and given not in (None, 2):
            raise ValueError(
                f"`VarunaStrategy(schedule={self.schedule!r})` places exactly 2 stages per rank, in a V; leave "
                f'`stages_per_rank` unset, or use `schedule="interleaved-1f1b"` for {given}.'
            )
        # With "auto" sizes an unset V is chosen with them (`placement_of`); a given one binds it.
        self.stages_per_rank = 2 if given is None and (not self.auto or self.schedule in V_SHAPED) else given
        if self.pipeline_parallel_size == 1:
            raise ValueError(
                f"`VarunaStrategy(schedule={self.schedule!r})` interleaves the stages of 2 or more ranks; with "
                "`pipeline_parallel_size=1` every stage would run on the one rank in turn. Use a larger "
                '`pipeline_parallel_size`, or `schedule="1f1b"`.'
            )

    @property
    def auto(self) -> frozenset[str]:
        """The names of the arguments given as ``"auto"``."""
        return frozenset(name for name in _AUTO_CHOICES if getattr(self, name) == "auto")

    def sizes_to_keep(
        self, pipeline_parallel_size: int, micro_batch_size: int, schedule: str, device: torch.device
    ) -> dict[str, Any]:
        """What the auto-configuration keeps (`ModelCosts.choose_config`): the global batch, of the sizes in use
        those not given as ``"auto"`` (None: chosen, as a micro-batch size not chosen yet), and the memory budget on
        ``device`` in bytes with the tiers it may spill to."""
        budget = None if self.memory_budget is None else resolve_budget(cast(int | float, self.memory_budget), device)
        return {
            "memory_budget": budget,
            "spill_tiers": self.spill_tiers,
            "global_batch_size": self.global_batch_size,
            "pipeline_parallel_size": None if "pipeline_parallel_size" in self.auto else pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "micro_batch_size": None if "micro_batch_size" in self.auto else micro_batch_size or None,
            "schedule": None if "schedule" in self.auto else schedule,
            "stages_per_rank": self.stages_per_rank if self.schedule in INTERLEAVED else None,
        }

    def layout_of(
        self, chosen: Config | SpilledConfig | None, schedule: str, pipeline_parallel_size: int, data_parallel_size: Any
    ) -> tuple[int, Any, int, bool]:
        """What `Topology.from_world` takes after the world: the sizes, the stages per rank (the auto-configuration's
        ``chosen`` one, else as given) and whether ``schedule`` places them in a V."""
        stages_per_rank = chosen.stages_per_rank if isinstance(chosen, Config) else self.stages_per_rank or 1
        return pipeline_parallel_size, data_parallel_size, stages_per_rank, schedule in V_SHAPED

    @property
    def spill_tiers(self) -> tuple[str, ...]:
        """Where the auto-configuration may spill to: none without a budget; host memory, and with ``spill_dir`` the
        disk."""
        if self.memory_budget is None:
            return ()
        return ("host", "disk") if self.spill_dir is not None else ("host",)

    def check_world_size(self, world_size: int) -> None:
        """Raise if the sizes given do not fit ``world_size`` processes, before any of them starts (sizes left "auto"
        are chosen to fit it)."""
        if "pipeline_parallel_size" in self.auto:
            return
        pipeline_parallel_size = cast(int, self.pipeline_parallel_size)
        topology = Topology.from_world(world_size, 0, pipeline_parallel_size, self.data_parallel_size)
        self.check_global_batch_splits(topology.data_parallel_size, world_size, pipeline_parallel_size)

    def check_global_batch_splits(self, data_parallel_size: int, world_size: int, pipeline_parallel_size: int) -> None:
        """Raise if ``global_batch_size`` does not split evenly over ``data_parallel_size`` replicas."""
        if self.global_batch_size is not None and self.global_batch_size % data_parallel_size:
            raise ValueError(
                f"`VarunaStrategy(global_batch_size={self.global_batch_size})` does not split evenly over "
                f"data_parallel_size={data_parallel_size} replicas (world size {world_size} / "
                f"pipeline_parallel_size {pipeline_parallel_size}). Use a global batch that is a multiple of "
                "the data-parallel sizes the job may run at, or another pipeline_parallel_size."
            )
