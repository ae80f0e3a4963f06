"""Partitioning (layer 2): CutPoint discovery, tracing, segment costs, stage balancing and the stage modules cut from a
model; what runs them is `pipeline`'s."""
