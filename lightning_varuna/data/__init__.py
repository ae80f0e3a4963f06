"""Training data (layer 1): a batch split into micro-batches and merged back, and a position within the epoch that
survives a change of world size."""
