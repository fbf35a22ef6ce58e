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

    def take_means():
        slots = jnp.minimum(blocks, n - 1)[:, :, None] * c + jnp.arange(c)  # [B, touched, C]
        keys = jnp.take_along_axis(k_cache, slots.reshape(b, -1)[:, :, None, None], axis=1)
        fresh = block_means(keys.reshape(b, touched, c, *k_cache.shape[2:]), dtype)
        # an incomplete block is left as it is; a block past the cache's last full one is dropped
        return means.at[jnp.arange(b)[:, None], jnp.where(complete, blocks, n)].set(fresh, mode="drop")

    # a single-token step completes a block once every C steps: the other steps read nothing
    return jax.lax.cond(complete.any(), take_means, lambda: means)


def moba_decode_attention(q, k_cache, v_cache, means, positions, *, block_size: int, top_k: int, scale):
    """q [B, T, Hq, D] at `positions` [B, T] over the cache (k/v [B, L, Hkv, D|Dv], already
    holding these tokens) -> [B, T, Hq, Dv]. The training semantics (docs/moba.md): each query
    head takes the top (top_k - 1) complete blocks strictly before its own by the unscaled
    float32 gate (ties to the earlier block) plus its own block causally. Only those blocks
    are read from the cache."""
    b, t, hq, d = q.shape
    length, hkv = k_cache.shape[1:3]
    n = means.shape[1]
    c = min(block_size, length)
    qf = q.astype(jnp.float32)
    own = positions // block_size  # [B, T] own block index
    # the own block's window, moved back where a short cache ends inside it; masked by slot
    first = jnp.minimum(own * block_size, length - c)
    slots = first[..., None] + jnp.arange(c)  # [B, T, C]
    ok = [(slots >= (own * block_size)[..., None]) & (slots <= positions[..., None])]  # [B, T, C]
    starts = [jnp.broadcast_to(first[..., None, None], (b, t, hq, 1))]  # [B, T, Hq, blocks]
    kk = min(top_k - 1, n)
    if kk > 0:
        qg = qf.reshape(b, t, hkv, hq // hkv, d)
        scores = jnp.einsum("btkgd,bnkd->btkgn", qg, means).reshape(b, t, hq, n)  # one dot per block
        candidate = jnp.arange(n) < own[..., None]  # [B, T, n]: complete blocks before the own one
        scores = jnp.where(candidate[:, :, None], scores, -jnp.inf)
        picks = jnp.stack(top_k_first(scores, kk), axis=-1)  # [B, T, Hq, k'] best first
        starts.append(jnp.minimum(picks, n - 1) * block_size)
        ok.append(jnp.repeat(jnp.arange(kk) < candidate.sum(-1)[..., None], c, axis=-1))  # real picks
    # computed once, not inside the gathers (XLA would fuse the top-k into every gathered element)
    starts = jax.lax.optimization_barrier(jnp.concatenate(starts, axis=-1))
    valid = jnp.concatenate(ok, axis=-1)[:, :, None]  # [B, T, 1, blocks * C]
    # one batch of single-query attentions over (1 + k') * C gathered keys per (row, query, head)
    m = b * t * hq
    keys = _head_blocks(k_cache, starts, c).reshape(m, -1, d)
    logits = jnp.einsum("md,mcd->mc", qf.reshape(m, d), keys, preferred_element_type=jnp.float32)
    logits = jnp.where(valid, logits.reshape(b, t, hq, -1) * scale, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).reshape(m, -1)
    values = _head_blocks(v_cache, starts, c).reshape(m, weights.shape[-1], -1)
    out = jnp.einsum("mc,mcd->md", weights, values, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, -1).astype(q.dtype)


def _head_blocks(cache, starts, size: int):
    """cache [B, L, Hkv, D], block starts [B, T, Hq, blocks] -> [B, T, Hq, blocks, size, D]: each
    query head reads its blocks from its own KV head only."""
    b, t, hq, nb = starts.shape
    heads = jnp.broadcast_to((jnp.arange(hq) // (hq // cache.shape[2]))[:, None], (hq, nb)).reshape(-1)

    def one(cache_b, start, head):  # [L, Hkv, D], scalar, scalar -> [size, D]
        return jax.lax.dynamic_slice(cache_b, (start, head, 0), (size, 1, cache_b.shape[-1]))[:, 0]

    per_query = lambda cache_b, starts_q: jax.vmap(one, (None, 0, 0))(cache_b, starts_q.reshape(-1), heads)
    per_row = lambda cache_b, starts_b: jax.vmap(per_query, (None, 0))(cache_b, starts_b)
    return jax.vmap(per_row)(cache, starts).reshape(b, t, hq, nb, size, cache.shape[-1])
