"""Measure point-to-point and all-reduce times between processes of this node (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from tqdm.auto import tqdm

from lightning_varuna.pipeline.gradients import sum_gradients
from lightning_varuna.profiling.processes import retried_on_port_clash, wait_all
from lightning_varuna.profiling.profile import LinearCost, ModelProfile

__all__ = ["profile_network"]


def profile_network(
    profile: ModelProfile,
    process_counts: list[int],
    *,
    repeats: int = 15,
    progress: bool = True,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> ModelProfile:
    """Add the network to ``profile``: send times of its boundary activations and gradient all-reduce times of
    parameter-sized buffers at every data-parallel width, measured with ``n`` processes running for each ``n``.

    Counts already in the profile are not measured again.
    """
    boundary = sorted(
        {t.output_bytes for s in profile.segments for by_mb in s.timings.values() for t in by_mb.values()}
    )
    boundary = [b for b in boundary if b > 0] or [2**16]
    total = sum(b for s in profile.segments for b in s.parameters.values())
    reduce_sizes = sorted({2**12, 2**15, 2**18, 2**21} | {max(2**12, int(total / 2**k)) for k in range(0, 6, 2)})
    boundary = sorted(set(boundary) | {min(boundary) // 8 or 1, max(boundary) * 4})
    todo = [n for n in sorted(set(process_counts)) if n > 1 and n not in profile.p2p]
    for n in tqdm(todo, desc="Profiling network", disable=not progress, unit="run"):
        job = [n, boundary, reduce_sizes, repeats, backend]
        measured = retried_on_port_clash(partial(_measured_by_processes, job, timeout_s))
        profile.p2p[n] = LinearCost.fit(measured["p2p"])
        profile.allreduce[n] = {
            int(d): LinearCost.fit([tuple(s) for s in samples]) for d, samples in measured["allreduce"].items()
        }
        profile.object_broadcast[n] = {int(d): seconds for d, seconds in measured["object_broadcast"].items()}
    return profile


def _measured_by_processes(job: list, timeout_s: float) -> dict:
    """``job``'s measurements, by ``job[0]`` processes on a free port of this machine."""
    n = job[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "network.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_network_port())}
        logs = [Path(tmp) / f"rank{rank}.log" for rank in range(n)]
        procs = []
        for rank, log in enumerate(logs):
            with open(log, "wb") as sink:
                command = [sys.executable, "-m", __name__, str(rank), json.dumps([*job, str(out)])]
                procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT))
        wait_all(procs, logs, timeout_s, f"Profiling the network with {n} processes")
        return json.loads(out.read_text())


def _measure(
    rank: int, world: int, p2p_sizes: list[int], reduce_sizes: list[int], repeats: int, backend: str, out: str
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result: dict = {"p2p": _point_to_point(rank, world, p2p_sizes, repeats, device)}
        result["allreduce"], result["object_broadcast"] = {}, {}
        for width in (d for d in range(2, world + 1) if world % d == 0):
            groups = [dist.new_group(list(range(g, g + width))) for g in range(0, world, width)]
            group = groups[rank // width]
            _time_allreduce(2**12, group, repeats, device)  # warm-up: the group's first collective connects it
            result["allreduce"][width] = [(n, _time_allreduce(n, group, repeats, device)) for n in reduce_sizes]
            result["object_broadcast"][width] = _time_object_broadcast(group, rank // width * width, repeats)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _point_to_point(rank: int, world: int, sizes: list[int], repeats: int, device: torch.device) -> list:
    """One-way time (half a round trip) between ranks 2k and 2k+1, all pairs at once (a lone rank idles)."""
    peer = rank ^ 1
    samples = []
    for nbytes in sizes:
        buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if peer < world:
                if rank % 2 == 0:
                    dist.send(buffer, peer)
                    dist.recv(buffer, peer)
                else:
                    dist.recv(buffer, peer)
                    dist.send(buffer, peer)
            _synchronize(device)
            times.append((time.perf_counter() - start) / 2)
        samples.append((nbytes, statistics.median(times[1:])))
    return samples


def _time_allreduce(nbytes: int, group: dist.ProcessGroup, repeats: int, device: torch.device) -> float:
    """The gradient sum of a stage holding ``nbytes`` of gradients, as VarunaStrategy runs it."""
    width = dist.get_world_size(group)
    elements = max(4, nbytes // 4)
    grads = list(torch.zeros(elements, dtype=torch.float32, device=device).chunk(4))
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        sum_gradients(grads, group, width)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _time_object_broadcast(group: dist.ProcessGroup, source: int, repeats: int) -> float:
    """What VarunaStrategy pays per step to share the last stage's logged values with the other stages."""
    times = []
    for _ in range(repeats + 1):
        payload = [{"loss": torch.tensor(1.0), "logged": {"train_loss": (torch.tensor(1.0), 1.0)}}]
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast_object_list(payload, src=source, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    _measure(int(sys.argv[1]), *json.loads(sys.argv[2]))
