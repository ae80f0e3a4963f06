"""Pipeline execution (layer 4): schedules, rank topology, a model cut into this rank's stage, the stage runtime, the
step that walks a schedule's actions, the gradient phase and tied weights."""
