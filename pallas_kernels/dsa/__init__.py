"""DSA kernels: sparse attention over each query's selected keys (docs/dsa.md), and what the
selection kernels share."""

import jax
import jax.numpy as jnp


def best_first(picks, scores):
    """picks [B, T, K] in key order (-1: none) and their index scores -> the picks best first, ties
    to the earlier key, -1 last (as `lax.top_k` orders them)."""
    order = jnp.where(picks >= 0, -scores, jnp.inf)
    tie = jnp.where(picks >= 0, picks, jnp.iinfo(jnp.int32).max)
    return jax.lax.sort((order, tie, picks), dimension=-1, num_keys=2)[2]
