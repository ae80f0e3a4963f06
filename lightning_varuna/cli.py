"""lightning-varuna: command-line tools around VarunaStrategy: checkpoints, profiling and auto-configuration."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import torch

from lightning_varuna.checkpoint.consolidate import consolidate
from lightning_varuna.storage import Storage

__all__ = ["main"]


def _storage(args: argparse.Namespace) -> Storage:
    """Storage with the command's ``--storage-options`` (JSON)."""
    return Storage(json.loads(args.storage_options) if args.storage_options else None)


def _consolidate(args: argparse.Namespace) -> None:
    storage = _storage(args)
    checkpoint = consolidate(args.checkpoint, storage)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    storage.write_bytes(args.output, buffer.getvalue())
    tensors = len(checkpoint["state_dict"])
    print(
        f"Wrote {args.output}: {tensors} tensors, epoch {checkpoint.get('epoch')}, global step "
        f"{checkpoint.get('global_step')} ({buffer.tell() / 1e6:.2f} MB)."
    )


def load_model(spec: str, init_args: str | None) -> torch.nn.Module:
    """Build ``module:Class`` or ``path/to/file.py:Class`` with the JSON ``init_args``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise SystemExit(f"MODEL must look like `package.module:Class` or `path/to/file.py:Class`, not {spec!r}.")
    if where.endswith(".py"):
        path = Path(where).resolve()
        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)(**json.loads(init_args or "{}"))


def _profile(args: argparse.Namespace) -> None:
    from lightning_varuna.profiling.network import profile_network
    from lightning_varuna.profiling.profile import ModelProfile
    from lightning_varuna.profiling.profiler import default_thread_counts, profile_model
    from lightning_varuna.spilling.bandwidth import measure_spill_tiers
    from lightning_varuna.step_runs import calibrate_with_steps

    storage = _storage(args)
    model = load_model(args.model, args.init_args)
    example = getattr(model, "example_input_array", None)
    if args.input_shape:
        shape = [int(n) for n in args.input_shape.split("x")]
        example = torch.zeros(shape, dtype=getattr(torch, args.input_dtype))
    if example is None:
        raise SystemExit(
            f"`{type(model).__name__}.example_input_array` is not set: give the profiler one batch of forward "
            "inputs with --input-shape (e.g. 8x64 --input-dtype int64) or set it in the model."
        )
    if isinstance(example, dict):
        forward_args, forward_kwargs = (), example
    else:
        forward_args, forward_kwargs = (example if isinstance(example, tuple) else (example,)), {}
    previous = ModelProfile.load(args.output, storage) if args.update and storage.exists(args.output) else None
    profile = profile_model(
        model,
        forward_args,
        forward_kwargs,
        micro_batch_sizes=args.micro_batch_sizes,
        thread_counts=default_thread_counts(args.devices),
        previous=previous,
    )
    profile_network(profile, list(range(2, args.devices + 1)))
    profile.spill = measure_spill_tiers(next(model.parameters()).device, args.spill_dir)
    profile.save(args.output, storage)
    untimed = [n for n in range(1, args.devices + 1) if n not in profile.overheads]
    if untimed and not args.no_step_runs and profile.device == "cpu":
        try:
            profile = calibrate_with_steps(profile, model, forward_args, forward_kwargs, process_counts=untimed)
        except Exception as error:
            raise SystemExit(
                f"The training steps that calibrate the profile failed ({type(error).__name__}: {error}); "
                f"{args.output} holds the profile without them. `--update` keeps what it has and runs them again; "
                "`--no-step-runs` leaves them out."
            ) from error
        profile.save(args.output, storage)
    print(f"Wrote {args.output}: {len(profile.segments)} segments, micro-batch sizes {profile.micro_batch_sizes}.")


def _autoconfig(args: argparse.Namespace) -> None:
    from lightning_varuna.partition.packing import parse_bytes
    from lightning_varuna.profiling.autoconfig import describe_choice, format_ranking, rank_configs
    from lightning_varuna.profiling.profile import ModelProfile
    from lightning_varuna.profiling.simulator import Config, simulate
    from lightning_varuna.profiling.spilled import simulate_spilled

    storage = _storage(args)
    profile = ModelProfile.load(args.profile, storage)
    memory = int(args.memory_gb * 2**30) if args.memory_gb else None
    if args.memory_budget:
        budget = parse_bytes(args.memory_budget)
        if isinstance(budget, float):
            raise SystemExit("`--memory-budget` is bytes or a size such as 2GiB here, not a share of a device.")
        memory = budget
    ranked = rank_configs(profile, args.devices, args.batch_size, memory_bytes=memory, nodes=args.nodes)
    print(format_ranking(ranked, args.top))
    print(f"\nAutoConfig {describe_choice(ranked)}")
    best = ranked[0].config
    if isinstance(best, Config):
        per_rank = f", stages_per_rank={best.stages_per_rank}" if best.stages_per_rank > 1 else ""
        print(
            f"Best: VarunaStrategy(pipeline_parallel_size={best.pipeline_parallel_size}, "
            f"micro_batch_size={best.micro_batch_size}, schedule={best.schedule!r}{per_rank}) on {args.devices} "
            f"devices, DataLoader batch {best.replica_batch_size} per replica."
        )
        timeline = simulate(profile, best, timeline=True).chrome_trace() if args.trace else ""
    else:
        spill_dir = "None" if best.tier == "host" else "'/path/to/spill'"
        print(
            f"Best: SpillingStrategy(memory_budget={best.memory_budget}, spill_dir={spill_dir}) on 1 device, "
            f"DataLoader batch {best.global_batch_size}."
        )
        timeline = simulate_spilled(profile, best, timeline=True).chrome_trace() if args.trace else ""
    if args.trace:
        Path(args.trace).write_text(timeline)
        print(f"Predicted timeline of the best: {args.trace} (open in https://ui.perfetto.dev)")


def _calibrate(args: argparse.Namespace) -> None:
    from lightning_varuna.profiling.calibration import calibrate, measured_step_s
    from lightning_varuna.profiling.profile import ModelProfile
    from lightning_varuna.profiling.simulator import Config, simulate
    from lightning_varuna.profiling.trace import read_chrome_trace

    storage = _storage(args)
    profile = ModelProfile.load(args.profile, storage)
    measured = []
    for url in args.trace:
        spans, metadata = read_chrome_trace(storage.read_bytes(url).decode())
        if "config" not in metadata:
            raise SystemExit(f"{url} does not say which configuration it measured; record it with PipelineTrace.")
        measured.append((Config(**metadata["config"]), spans))
    calibrated = calibrate(profile, measured)
    for config, spans in measured:
        before, after = simulate(profile, config).step_s, simulate(calibrated, config).step_s
        print(
            f"{config}: measured {measured_step_s(spans) * 1e3:.1f} ms, predicted {before * 1e3:.1f} ms before and "
            f"{after * 1e3:.1f} ms after."
        )
    for processes in sorted({config.processes_per_node for config, _ in measured}):
        print(f"With {processes} process(es) per node: {calibrated.overheads[processes]}.")
    output = args.output or args.profile
    calibrated.save(output, storage)
    print(f"Wrote {output}.")


def build_parser() -> argparse.ArgumentParser:
    """The `lightning-varuna` command line: one sub-command per tool."""
    parser = argparse.ArgumentParser(
        prog="lightning-varuna",
        description=__doc__,
        epilog="Run `lightning-varuna COMMAND --help` for the options of a command.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    merge = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one plain Lightning .ckpt (Model.load_from_checkpoint reads it)",
        description="Write a sharded checkpoint as one plain Lightning .ckpt (Model.load_from_checkpoint reads it).",
    )
    merge.add_argument("checkpoint", help="the checkpoint folder (any fsspec URL), e.g. s3://bucket/run/last.ckpt")
    merge.add_argument("output", help="the .ckpt file to write (any fsspec URL)")
    merge.add_argument("--storage-options", help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://..."}\'')
    merge.set_defaults(run=_consolidate)
    profile = commands.add_parser(
        "profile",
        help="measure each CutPoint segment, the network and a few training steps; write a JSON profile for autoconfig",
        description="Measure each CutPoint segment of a model (time, activation and parameter memory, optimizer step) "
        "and the network between processes, and time a few training steps of it per process count (on a CPU: what a "
        "step costs beyond its segments, as `calibrate` learns it); write a JSON profile for autoconfig and "
        "VarunaStrategy(profile=...).",
    )
    profile.add_argument("model", help="`package.module:Class` or `path/to/file.py:Class`; needs example_input_array")
    profile.add_argument("--init-args", help="constructor arguments as JSON, e.g. '{\"layers\": 8}'")
    profile.add_argument("--input-shape", help="forward input of zeros of this shape, e.g. 8x64 (rows x ...)")
    profile.add_argument("--input-dtype", default="float32", help="dtype of --input-shape, e.g. int64")
    profile.add_argument(
        "--micro-batch-sizes",
        type=int,
        nargs="+",
        help="micro-batch sizes to time each segment at (default: 1 2 4 8, from 2 for a model with BatchNorm); the "
        "simulator interpolates between them",
    )
    profile.add_argument("--devices", type=int, default=1, help="processes per node to measure communication with")
    profile.add_argument("--output", required=True, help="where to write the profile (any fsspec URL)")
    profile.add_argument("--update", action="store_true", help="keep what the profile at --output already has")
    profile.add_argument(
        "--no-step-runs",
        action="store_true",
        help="leave out the few training steps per process count that calibrate the profile (on a GPU they are left "
        "out: calibrate with `lightning-varuna calibrate` from a PipelineTrace of a real run instead)",
    )
    profile.add_argument(
        "--spill-dir",
        help="a folder on the disk SpillingStrategy will spill to, where the disk tier is timed (default: the system's "
        "temporary folder)",
    )
    profile.add_argument("--storage-options", help="fsspec options as JSON")
    profile.set_defaults(run=_profile)
    auto = commands.add_parser(
        "autoconfig",
        help="rank every pipeline configuration (and, given a memory budget, spilled training) by simulated step time",
        description="Simulate every (stages, replicas, micro-batch size, schedule) for the devices and, given a memory "
        "budget per device, training spilled on one device; rank them by predicted step time; print the table, the "
        "choice and the runner-up, and the strategy to use.",
    )
    auto.add_argument("--profile", required=True, help="a profile written by `lightning-varuna profile`")
    auto.add_argument("--devices", type=int, required=True, help="devices (processes) in all")
    auto.add_argument("--batch-size", type=int, required=True, help="the global batch size")
    auto.add_argument("--nodes", type=int, default=1, help="machines the devices are spread over (default: 1)")
    auto.add_argument("--memory-gb", type=float, help="memory per device; configurations needing more are dropped")
    auto.add_argument(
        "--memory-budget",
        help="memory per device as a size (e.g. 32MiB, 2GB); configurations needing more are dropped, and training "
        "spilled on one device is ranked too",
    )
    auto.add_argument("--top", type=int, default=20, help="rows of the table")
    auto.add_argument("--trace", help="write the best configuration's predicted timeline here (Chrome trace JSON)")
    auto.add_argument("--storage-options", help="fsspec options as JSON")
    auto.set_defaults(run=_autoconfig)
    calibration = commands.add_parser(
        "calibrate",
        help="learn from measured steps (PipelineTrace files) what the profile's segments leave out",
        description="Learn from measured steps (PipelineTrace files) what the profile's segments leave out: per "
        "forward, per backward, per message and per step costs; write the calibrated profile.",
    )
    calibration.add_argument("--profile", required=True, help="the profile to calibrate (any fsspec URL)")
    calibration.add_argument(
        "--trace",
        required=True,
        nargs="+",
        help="PipelineTrace files: per process count, one or more micro-batch sizes",
    )
    calibration.add_argument("--output", help="where to write the calibrated profile; default: --profile")
    calibration.add_argument("--storage-options", help="fsspec options as JSON")
    calibration.set_defaults(run=_calibrate)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
