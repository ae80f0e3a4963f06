"""Sharded checkpoints on any fsspec URL that survive a change of pipeline shape."""
