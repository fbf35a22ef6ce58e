"""Dense causal attention with packed-document masking (the `dense` core)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_segment_mask(segment_ids: jax.Array | None, q_len: int, kv_len: int) -> jax.Array:
    """[B or 1, 1, q_len, kv_len] bool: causal and, with segment ids [B, S], same document."""
    causal = jnp.tril(jnp.ones((q_len, kv_len), bool), k=kv_len - q_len)[None, None]
    if segment_ids is None:
        return causal
    same = segment_ids[:, None, -q_len:, None] == segment_ids[:, None, None, :]
    return causal & same


def dense_attention(q, k, v, *, segment_ids=None, scale=None):
    """q: [B, S, Hq, D], k/v: [B, S, Hkv, D] (Hkv divides Hq) -> [B, S, Hq, Dv].

    Softmax over every earlier key of the same document. XLA implementation of
    `jax.nn.dot_product_attention`, which handles GQA without copying K/V.
    """
    mask = causal_segment_mask(segment_ids, q.shape[1], k.shape[1])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla").astype(q.dtype)
