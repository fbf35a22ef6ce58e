"""MoBA decoding over a KV cache (XLA): the gate reads cached block means, attention reads
only the selected blocks, so a step costs top_k * block_size keys plus one dot product per
block, not the whole context.

The cache holds, beside K and V, `block_means` [B, L // C, Hkv, D] float32: the mean key of
every complete block, written when the token that completes a block arrives (from that
block's C cached keys, rounded to the compute dtype as the training gate rounds it), so no
step re-reads the context. A row is one document whose tokens sit at positions 0, 1, ... of
the cache; every decode call writes contiguous positions [B, T]. Slots a right-padded prompt
filled with padding lie in blocks that are only complete once the row's own tokens have
overwritten them, and the block's mean is taken then.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.dense import masked_attention
from effattn_jax.ops.routing import block_means, top_k_first


def empty_block_means(batch: int, max_len: int, kv_heads: int, head_dim: int, block_size: int) -> jax.Array:
    """[B, L // C, Hkv, D] float32 zeros: a block that is never complete needs no slot."""
    return jnp.zeros((batch, max_len // block_size, kv_heads, head_dim), jnp.float32)


def prefill_block_means(means, k_cache, length: int, *, block_size: int, dtype) -> jax.Array:
    """The means after a prefill that wrote positions [0, length) of every row."""
    b, _, hkv, d = k_cache.shape
    n = min(length // block_size, means.shape[1])
    blocks = k_cache[:, : n * block_size].reshape(b, n, block_size, hkv, d)
    return means.at[:, :n].set(block_means(blocks, dtype))


def update_block_means(means, k_cache, positions, *, block_size: int, dtype) -> jax.Array:
    """The means after a call that wrote the contiguous `positions` [B, T] into `k_cache`
    [B, L, Hkv, D]: every block those positions complete gets its mean (C keys read per block)."""
    b, t = positions.shape
    c, n = block_size, means.shape[1]
    if n == 0:
        return means
    touched = min(n, 1 if t == 1 else (t - 1) // c + 2)  # blocks a run of t positions can overlap
    blocks = positions[:, :1] // c + jnp.arange(touched)  # [B, touched]
    complete = (blocks + 1) * c - 1 <= positions[:, -1:]
    slots = jnp.minimum(blocks, n - 1)[:, :, None] * c + jnp.arange(c)  # [B, touched, C]
    keys = jnp.take_along_axis(k_cache, slots.reshape(b, -1)[:, :, None, None], axis=1)
    fresh = block_means(keys.reshape(b, touched, c, *k_cache.shape[2:]), dtype)
    rows = jnp.arange(b)[:, None]
    # an incomplete block is left as it is; a block past the cache's last full one is dropped
    blocks = jnp.where(complete, blocks, n)
    return means.at[rows, blocks].set(fresh, mode="drop")


def moba_decode_attention(q, k_cache, v_cache, means, positions, *, block_size: int, top_k: int, scale):
    """q [B, T, Hq, D] at `positions` [B, T] over the cache (k/v [B, L, Hkv, D|Dv], already
    holding these tokens) -> [B, T, Hq, Dv]. The training semantics (docs/moba.md): each query
    head takes the top (top_k - 1) complete blocks strictly before its own by the unscaled
    float32 gate (ties to the earlier block) plus its own block causally."""
    b, t, hq, d = q.shape
    hkv, c, n = k_cache.shape[2], block_size, means.shape[1]
    own = positions // c  # [B, T] own block index
    slot = jnp.arange(c)
    own_slots = own[..., None] * c + slot  # [B, T, C]
    kk = min(top_k - 1, n)
    key_slots = jnp.broadcast_to(own_slots[:, :, None], (b, t, hq, c))  # [B, T, Hq, keys]
    valid = key_slots <= positions[:, :, None, None]
    if kk > 0:
        qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
        scores = jnp.einsum("btkgd,bnkd->btkgn", qg, means).reshape(b, t, hq, n)
        candidate = jnp.arange(n) < own[..., None]  # [B, T, n]: complete blocks before the own one
        scores = jnp.where(candidate[:, :, None], scores, -jnp.inf)
        count = candidate.sum(-1)[:, :, None]  # [B, T, 1]
        picks = jnp.stack(top_k_first(scores, kk), axis=-1)  # [B, T, Hq, k'] best first
        past_slots = (jnp.minimum(picks, n - 1)[..., None] * c + slot).reshape(b, t, hq, kk * c)
        past_valid = jnp.repeat(jnp.arange(kk) < count[..., None], c, axis=-1)  # [B, T, 1, k' C]
        key_slots = jnp.concatenate([key_slots, past_slots], axis=-1)
        valid = jnp.concatenate([valid, jnp.broadcast_to(past_valid, past_slots.shape)], axis=-1)
    key_slots = jnp.minimum(key_slots, k_cache.shape[1] - 1)  # an own block running past the cache
    return _attend_slots(q, k_cache, v_cache, key_slots, valid, scale)


def _attend_slots(q, k_cache, v_cache, key_slots, valid, scale):
    """Softmax attention of each (query, head) over its own cache slots [B, T, Hq, N]: only those
    K/V rows are gathered."""
    b, t, hq, d = q.shape
    hkv = k_cache.shape[2]
    rows = jnp.arange(b)[:, None, None, None]
    heads = (jnp.arange(hq) // (hq // hkv))[None, None, :, None]
    k = k_cache[rows, key_slots, heads]  # [B, T, Hq, N, D]
    v = v_cache[rows, key_slots, heads]  # [B, T, Hq, N, Dv]
    # one query per (row, position, head): a batch of B * T * Hq single-query attentions
    m, keys = b * t * hq, key_slots.shape[-1]
    out = masked_attention(
        q.reshape(m, 1, 1, d),
        k.reshape(m, keys, 1, d),
        v.reshape(m, keys, 1, v.shape[-1]),
        valid.reshape(m, 1, 1, keys),
        scale,
    )
    return out.reshape(b, t, hq, -1)
