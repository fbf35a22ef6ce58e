"""Pure-JAX attention math: reference oracles and XLA paths (no Flax)."""
