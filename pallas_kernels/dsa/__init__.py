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


def query_documents(segment_ids, q_index, b: int, t: int, s: int):
    """The selection kernels' view of who sees what: the keys' documents [B, S] (one document where
    `segment_ids` is None), the queries' positions among the keys [B, T] (`q_index`, default 0 ..
    T - 1) and each query's document, the one at its position [B, T] (int32 each)."""
    seg = jnp.ones((b, s), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    pos = (
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if q_index is None
        else q_index.astype(jnp.int32)
    )
    return seg, pos, jnp.take_along_axis(seg, pos, axis=1)
