"""Partitioning: CutPoint discovery, segment costs, stage assignment and stage modules."""
