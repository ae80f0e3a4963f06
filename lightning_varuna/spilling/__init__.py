"""Spilling (layer 6, Hydra): a model's shards take turns on one device, the others in host memory or on disk: the
packing into shards, prefetch, recompute from shard-boundary activations, the optimizer stepped shard by shard, and
spilled checkpoints (see `SpillingStrategy`)."""
