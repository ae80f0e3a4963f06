"""``lightning-varuna``: command-line tools around VarunaStrategy checkpoints."""

from __future__ import annotations

import argparse
import io
import json
import sys

import torch

from lightning_varuna.checkpoint.consolidate import consolidate
from lightning_varuna.checkpoint.storage import Storage

__all__ = ["main"]


def _consolidate(args: argparse.Namespace) -> None:
    storage = Storage(json.loads(args.storage_options) if args.storage_options else None)
    checkpoint = consolidate(args.checkpoint, storage)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    storage.write_bytes(args.output, buffer.getvalue())
    tensors = len(checkpoint["state_dict"])
    print(
        f"Wrote {args.output}: {tensors} tensors, epoch {checkpoint.get('epoch')}, global step "
        f"{checkpoint.get('global_step')} ({buffer.tell() / 1e6:.2f} MB)."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-varuna", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one plain Lightning .ckpt (Model.load_from_checkpoint reads it)",
    )
    merge.add_argument("checkpoint", help="the checkpoint folder (any fsspec URL), e.g. s3://bucket/run/last.ckpt")
    merge.add_argument("output", help="the .ckpt file to write (any fsspec URL)")
    merge.add_argument("--storage-options", help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://..."}\'')
    merge.set_defaults(run=_consolidate)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
