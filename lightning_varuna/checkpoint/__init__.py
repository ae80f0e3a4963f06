"""Checkpoints (layer 3): the sharded format on any fsspec URL, per CutPoint segment, that a run of another pipeline
shape or a spilled run loads; state keyed by parameter name, asynchronous uploads, and consolidation to one plain
Lightning checkpoint."""
