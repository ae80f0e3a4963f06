"""Hydra's spilling: a model's shards take turns on one device (see `SpillingStrategy`)."""
