"""Training: state and shardings, the jitted step, the loop, metrics."""
