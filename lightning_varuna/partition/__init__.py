"""Partitioning (layer 2): CutPoint discovery, tracing, segment costs, stage balancing, the stage modules cut from a
model, and the packing of segments into the shards of a spilled model; what runs them is `pipeline`'s and
`spilling`'s."""
