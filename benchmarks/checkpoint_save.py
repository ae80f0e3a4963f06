"""How long a checkpoint save stalls training, with and without ``checkpoint_tempdir``, and how fast sharded
checkpoints move compared with a plain copy of the same bytes to the same store.

Run from the repository root (about 10 minutes on 2 CPU cores)::

    python benchmarks/checkpoint_save.py [--repeats 3]

The model is examples/gpt.py's GPT (8 layers, dim 512, block 64: 25.3 M parameters; with AdamW's two moments the
checkpoint holds about 300 MB of tensors), trained with ``VarunaStrategy(pipeline_parallel_size=2)`` in 2 processes
(gloo, one thread each). Two stores: a local folder and an S3-compatible server (moto) on loopback started by this
script. Modes: ``direct`` (DCP writes to the URL with this package's settings: several files per rank on a remote
store, read back by `RangeReader`), ``direct, DCP's writer/reader`` (the same with torch's stock ``FsspecWriter`` /
``FsspecReader``: one file per rank, items read in plan order through the stream's read-ahead cache) and ``tempdir``
(DCP writes to a local folder and a worker thread uploads). For each store and mode the run trains 3 steps, saves with
``trainer.save_checkpoint``, trains 5 more steps, then loads the checkpoint back with the strategy (each rank reads its
stage). Reported per mode, slowest rank, median over the repeats:

* ``stall``: wall time of ``trainer.save_checkpoint`` (training is stopped for this long);
* ``until committed``: from the save's start until the checkpoint is complete on the store (for ``tempdir``, when the
  background upload and commit finished);
* ``step during upload``: median step time while the upload runs, against the median step before the save;
* ``load``: wall time of ``strategy.load_checkpoint``.

The plain-copy baseline writes one file of the checkpoint's total size to the same store and reads it back, from one
process (``shutil.copyfile`` for the folder, ``s3fs`` ``put_file`` / ``get_file`` for S3), once per repeat; each save
and load is compared with the copy of its own repeat. Figures (every run's, and the medians) go to
``benchmarks/results/checkpoint_save.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "checkpoint_save.json")


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from gpt import GPT, CharDataset, make_text

    from lightning_varuna import VarunaStrategy

    if args.dcp_defaults:
        use_dcp_defaults()
    torch.set_num_threads(1)
    L.seed_everything(0)
    data = CharDataset(make_text(), block_size=64)
    model = GPT(len(data.vocab), block_size=64, dim=512, layers=8, heads=8)
    strategy = VarunaStrategy(
        pipeline_parallel_size=2, micro_batch_size=2, checkpoint_tempdir=args.tempdir, storage_options=None
    )

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.steps: list[tuple[int, float, bool]] = []
            self.figures: dict[str, float] = {}

        def on_train_batch_start(self, trainer, *_) -> None:  # noqa: ANN001
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *_) -> None:  # noqa: ANN001
            uploads = strategy._checkpoints._uploads
            self.steps.append((trainer.global_step, time.perf_counter() - self.start, uploads.in_flight))
            if trainer.global_step == 3:
                begin = time.perf_counter()
                trainer.save_checkpoint(args.url)
                self.saved, self.figures["stall"] = begin, time.perf_counter() - begin
                if not uploads.in_flight:
                    self.figures["until committed"] = self.figures["stall"]
            elif "stall" in self.figures and "until committed" not in self.figures and not uploads.in_flight:
                self.figures["until committed"] = time.perf_counter() - self.saved

    measure = Measure()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=8,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    if "until committed" not in measure.figures:
        strategy._checkpoints.wait()
        measure.figures["until committed"] = time.perf_counter() - measure.saved
    strategy.barrier()
    begin = time.perf_counter()
    strategy.load_checkpoint(args.url)
    measure.figures["load"] = time.perf_counter() - begin
    before = [t for step, t, _ in measure.steps if 1 < step <= 3]
    during = [t for step, t, uploading in measure.steps if step > 3 and uploading]
    measure.figures["step before save"] = statistics.median(before)
    measure.figures["step during upload"] = statistics.median(during) if during else None
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(measure.figures, f)


def use_dcp_defaults() -> None:
    """Write and read as torch.distributed.checkpoint's own fsspec writer and reader do (one file and one thread per
    rank; items read in plan order through the stream's read-ahead cache): the comparison for our settings."""
    from lightning_varuna._torch_private import FsspecReader, FsspecWriter
    from lightning_varuna.storage import Storage

    Storage.dcp_writer = lambda self, url: FsspecWriter(str(url), sync_files=False, **self.fs_options)
    Storage.dcp_reader = lambda self, url: FsspecReader(str(url), **self.fs_options)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def folder_bytes(storage, url: str) -> int:  # noqa: ANN001
    fs, path = storage.fs(url)
    return sum(fs.du(path, total=False).values())


def plain_copy(storage, url: str, size: int) -> dict[str, float]:  # noqa: ANN001
    """Write then read one file of ``size`` bytes at ``url`` with the store's plain copy."""
    with tempfile.TemporaryDirectory() as tmp:
        source, back = os.path.join(tmp, "blob"), os.path.join(tmp, "back")
        with open(source, "wb") as f:
            f.write(os.urandom(size))
        fs, path = storage.fs(url)
        upload, download = (fs.put_file, fs.get_file) if url.startswith("s3://") else (shutil.copyfile,) * 2
        begin = time.perf_counter()
        upload(source, path)
        write = time.perf_counter() - begin
        begin = time.perf_counter()
        download(path, back)
        read = time.perf_counter() - begin
        fs.rm(path)
    return {"write": write, "read": read}


MODES = {  # name: worker flags
    "direct, DCP's writer/reader": ["--dcp-defaults"],
    "direct": [],
    "tempdir": ["--tempdir", "{tmp}/local-temp"],
}


def slowest_rank(ranks: list[dict]) -> dict:
    return {key: max((r[key] for r in ranks if r[key] is not None), default=None) for key in ranks[0]}


def ratios(values: list[float]) -> str:
    """``median x (min-max)`` of the ratios of the repeats."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def spread(runs: list[dict]) -> dict:
    """The median of each figure over the repeats, with every run's figures kept under ``runs``."""
    keys = [key for key in runs[0] if all(run[key] is not None for run in runs)]
    return {**{key: statistics.median(run[key] for run in runs) for key in keys}, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each store and mode (the median is reported)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--tempdir", help=argparse.SUPPRESS)
    parser.add_argument("--dcp-defaults", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import s3fs
    from moto.server import ThreadedMotoServer

    from lightning_varuna.storage import Storage

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "bench", "secret": "bench"}
    s3fs.S3FileSystem(**options).mkdir("bench")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **{f"FSSPEC_S3_{k.upper()}": v for k, v in options.items()}}
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {"local folder": os.path.join(tmp, "store"), "s3 (moto, loopback)": "s3://bench/run"}
        storage = Storage(options)
        for repeat in range(args.repeats):  # repeats outermost: a slow spell of the machine hits every mode alike
            for store, root in stores.items():
                for mode, flags in MODES.items():
                    url = f"{root}/{mode.split(',')[0]}-{repeat}.ckpt"
                    command = [sys.executable, __file__, "--worker", "--url", url, "--out", os.path.join(tmp, "fig")]
                    command += [flag.format(tmp=tmp) for flag in flags]
                    print(f"run {repeat + 1}/{args.repeats}: {store} / {mode} ...", flush=True)
                    subprocess.run(command, check=True, env=env, capture_output=True)
                    ranks = [read_json(os.path.join(tmp, f"fig.rank{r}.json")) for r in range(2)]
                    figures = slowest_rank(ranks)
                    figures["MB"] = folder_bytes(storage, url) / 1e6
                    storage.remove(url)
                    runs.setdefault(f"{store} / {mode}", []).append(figures)
                size = int(runs[f"{store} / direct"][-1]["MB"] * 1e6)
                runs.setdefault(f"{store} / plain copy", []).append(plain_copy(storage, f"{root}/plain.bin", size))
    server.stop()
    results = {name: spread(figures) for name, figures in runs.items()}

    print(
        f"\n{'store / mode (median)':<46}{'MB':>5}{'stall s':>9}{'committed s':>13}{'step s (before/during)':>24}"
        f"{'load s':>8}"
    )
    for name, fig in results.items():
        if name.endswith("plain copy"):
            continue
        steps = f"{fig['step before save']:.2f} / {fig.get('step during upload', float('nan')):.2f}"
        times = f"{fig['stall']:>9.2f}{fig['until committed']:>13.2f}{steps:>24}{fig['load']:>8.2f}"
        print(f"{name:<46}{fig['MB']:>5.0f}{times}")
    print("\nThroughput (MB/s) against a plain copy of the same bytes to the same store, in the same repeat:")
    for store in stores:
        plain = runs[f"{store} / plain copy"]
        for mode in ("direct, DCP's writer/reader", "direct"):
            ours = runs[f"{store} / {mode}"]
            save = [run["MB"] / run["stall"] for run in ours]
            load = [run["MB"] / run["load"] for run in ours]
            save_x = [run["write"] / mine["stall"] for run, mine in zip(plain, ours)]
            load_x = [run["read"] / mine["load"] for run, mine in zip(plain, ours)]
            results[f"{store} / {mode}"]["x plain copy"] = {"save": save_x, "load": load_x}
            print(
                f"  {store + ' / ' + mode:<48} save {statistics.median(save):5.0f} {ratios(save_x)}   "
                f"load {statistics.median(load):5.0f} {ratios(load_x)}"
            )
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
