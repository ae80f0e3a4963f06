"""Parameters that several stages use (tied weights): keep their copies identical.

Tracing gives each stage that uses a tied weight (say the embedding on the first stage and the LM head on
the last) its own copy. Starting from the same value and applying the same summed gradient keeps them
equal, exactly like the one tensor of single-device training. Varuna's explicit ``shared_weights`` pairs are
tied in the module first (`tie_weights`), so that tracing finds them as it finds the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.pipeline.topology import Topology

__all__ = ["SharedParameters", "tie_weights"]


class SharedParameters:
    """Which of this rank's parameters other stages hold too, and the process groups to sync them.

    Args:
        stage_parameters: canonical parameter names used by each stage (of all `Topology.num_stages`).
        topology: this rank's place in the job.
        own: this rank's parameters by canonical name.
    """

    def __init__(self, stage_parameters: list[set[str]], topology: Topology, own: dict[str, nn.Parameter]) -> None:
        # By pipeline position: stages of one rank (interleaved) use one tensor, whose gradients add up there.
        holders: dict[str, list[int]] = {}
        for stage, names in enumerate(stage_parameters):
            for name in sorted(names):
                position = topology.pp_rank_of(stage)
                if position not in holders.setdefault(name, []):
                    holders[name].append(position)
        shared = {name: tuple(sorted(stages)) for name, stages in sorted(holders.items()) if len(stages) > 1}
        groups = {}
        for stages in sorted(set(shared.values())):
            groups[stages] = topology.new_groups(
                [[topology.stage_ranks(d)[s] for s in stages] for d in range(topology.data_parallel_size)]
            )
        self._topology = topology
        self._mine = [
            (own[name], stages, groups[stages]) for name, stages in shared.items() if topology.pp_rank in stages
        ]
        self._counted_elsewhere = {id(p) for p, stages, _ in self._mine if stages[0] != topology.pp_rank}
        self._own = own

    @property
    def names(self) -> list[str]:
        """Canonical names of this rank's parameters that other stages hold too."""
        return [name for name, p in self._own.items() if any(p is q for q, _, _ in self._mine)]

    def broadcast_initial_values(self, replica_group: dist.ProcessGroup | None) -> None:
        """Start every replica and every stage from the same values (those of replica 0 / the first holder)."""
        topo = self._topology
        if topo.data_parallel_size > 1:
            for p in self._own.values():
                dist.broadcast(p.data, src=topo.replica_ranks()[0], group=replica_group)
        for p, stages, group in self._mine:
            dist.broadcast(p.data, src=topo.stage_ranks()[stages[0]], group=group)

    def sum_across_stages(self, grads: dict[Tensor, Tensor]) -> None:
        """Sum, in place, the gradients of the shared parameters over the stages that hold them. One without a
        gradient here (frozen) is summed as zeros, so that every holder takes part whatever it froze."""
        for p, _, group in self._mine:
            dist.all_reduce(grads[p] if p in grads else torch.zeros_like(p), group=group)

    def counted_once(self, params: list[Tensor]) -> list[Tensor]:
        """``params`` less the shared ones whose first holder is another stage (for a global norm)."""
        return [p for p in params if id(p) not in self._counted_elsewhere]


def tie_weights(module: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Make the second parameter of each pair in ``module`` the first (Varuna's ``shared_weights``)."""
    for keep, tie in pairs:
        owner, _, name = tie.rpartition(".")
        module.get_submodule(owner).register_parameter(name, module.get_parameter(keep))
