"""Write one ``torch.distributed.checkpoint`` save from state dicts made one after another, in one process.

A model spilled shard by shard has no moment at which all its tensors are in memory. Each piece (the tensors of
one shard) is planned and written as if one rank of a job had written it (its own ``__<k>_*.distcp`` files), and
dropped before the next is made; the index written at the end covers them all, so the save reads like any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter, Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["write_pieces"]


def write_pieces(writer: FileSystemWriter, pieces: Iterable[dict[str, Any]]) -> None:
    """Write the nested state dicts ``pieces`` (disjoint keys) as one save through ``writer``."""
    writer.set_up_storage_writer(True)
    state_dict_metadata: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    results: list[WriteResult] = []
    for k, piece in enumerate(pieces):
        planner = DefaultSavePlanner()
        planner.set_up_planner(piece, storage_meta=writer.storage_meta(), is_coordinator=True)
        [plan], metadata = planner.create_global_plan([writer.prepare_local_plan(planner.create_local_plan())])
        # The writer names the files of the k-th plan of a save after k: this piece's files are the k-th rank's.
        plan = writer.prepare_global_plan([SavePlan([])] * k + [plan])[k]
        written = writer.write_data(planner.finish_plan(plan), planner)
        written.wait()
        results.extend(written.value())
        state_dict_metadata.update(metadata.state_dict_metadata)
        planner_data.update(metadata.planner_data or {})
    writer.finish(Metadata(state_dict_metadata, planner_data=planner_data), [results])
