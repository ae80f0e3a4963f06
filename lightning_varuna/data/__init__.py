"""Training data that keeps its place: a position within the epoch that survives a change of world size."""
