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


def masked_attention(q, k, v, mask, scale):
    """Plain softmax attention, float32 softmax. q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv],
    mask broadcastable to [B, Hq, T, S] (True = attend) -> [B, T, Hq, Dv] in q's dtype."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.broadcast_to(mask, (b, hq, t, k.shape[1])).reshape(b, hkv, hq // hkv, t, k.shape[1])
    logits = jnp.where(mask, logits, -jnp.inf)
    # softmax normalised after the value product: divides [T, Dv] rather than [T, S] (the
    # downstream eval's decode shapes, BENCHMARKS.md); the max is held constant, as in jax.nn.softmax
    weights = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    out = jnp.einsum("bkgts,bskd->bkgtd", weights, v.astype(jnp.float32)) / weights.sum(-1, keepdims=True)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, v.shape[-1]).astype(q.dtype)


def dense_attention(q, k, v, *, segment_ids=None, scale=None):
    """q: [B, S, Hq, D], k/v: [B, S, Hkv, D] (Hkv divides Hq) -> [B, S, Hq, Dv].

    Softmax over every earlier key of the same document. XLA implementation of
    `jax.nn.dot_product_attention`, which handles GQA without copying K/V.
    """
    mask = causal_segment_mask(segment_ids, q.shape[1], k.shape[1])
    if v.shape[-1] != q.shape[-1]:  # jax.nn.dot_product_attention needs equal head dims
        return masked_attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla").astype(q.dtype)
