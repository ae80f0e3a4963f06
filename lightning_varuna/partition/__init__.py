"""Partitioning: CutPoint discovery, segment costs, stage assignment and stage modules, and the packing of
segments into the shards of a spilled model."""
