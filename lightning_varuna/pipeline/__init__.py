"""Pipeline execution: schedules, micro-batches, rank topology, the stage runtime and tied weights."""
