"""Profile a model's segments and the network, simulate pipeline configurations, and pick the fastest."""
