"""Packed documents: positions inside each document and MoBA block starts, from segment ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its document: [B, S] int32, restarting at 0 per segment."""
    b, s = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    start = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    return idx - first


def document_positions(segment_ids: jax.Array | None, b: int, s: int) -> jax.Array:
    """[B, S] int32 positions inside the document; one document per row without segment ids."""
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return segment_positions(segment_ids)


def block_starts(segment_ids: jax.Array | None, b: int, s: int, block_size: int) -> jax.Array:
    """[B, S] int32: the first position of the block each token belongs to (blocks restart
    at every document's first token)."""
    pos = document_positions(segment_ids, b, s)
    return jnp.arange(s, dtype=jnp.int32)[None] - pos % block_size
