"""Storage (layer 0): the one place that reaches fsspec URLs (a local path, ``s3://``, ``az://``, ``gs://``,
``memory://``), and torch.distributed.checkpoint's readers and writers for them."""

from lightning_varuna.storage.fsspec_files import REMOTE_WRITE_THREADS, Storage, join

__all__ = ["REMOTE_WRITE_THREADS", "Storage", "join"]
