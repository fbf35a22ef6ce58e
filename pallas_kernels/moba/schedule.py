"""Tile schedules for MoBA: which queries run against which keys, as index tables.

Work is organised per *tile*: up to `q_tile` query rows (one batch row, one query
head) that all look at one contiguous key range of the same KV head. Each row
carries its own visible key interval [lo, hi] (inclusive), so one attention
routine serves both parts of MoBA:

* past tiles (KV-block-centric, megablox style): the (query, head, selected
  earlier block) pairs sorted by block; each block's queries are cut into
  tiles, so work is proportional to the pairs, whatever the routing. A row
  sees the whole block: [start, start + block_size - 1].
* own tiles: consecutive queries of one head; a row sees its own block up to
  itself: [own_start, t].

Earlier blocks are full and disjoint, so a row holds at most S // block_size of
them and the number of past tiles has a static bound. Nothing here is dense in
S x S. Pure jnp: shared by the XLA path and the Pallas kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Tiles(NamedTuple):
    """rows [T, Qt]: flat query index (b * S + t) * Hq + h of each tile row, -1 = padding.
    kv_row [T]: b * Hkv + kv head; key_start [T]: first key position the tile may see;
    lo, hi [T, Qt]: visible key interval of each row (empty for padding: lo > hi)."""

    rows: jax.Array
    kv_row: jax.Array
    key_start: jax.Array
    lo: jax.Array
    hi: jax.Array


class PastTiles(NamedTuple):
    tiles: Tiles
    pair_tile: jax.Array  # [P] tile of each (b, t, h, i) pair (clipped; check `valid`)
    pair_slot: jax.Array  # [P] row inside that tile
    valid: jax.Array  # [P] the pair is a real selection


def past_tiles(past_start: jax.Array, *, num_kv_heads: int, block_size: int, q_tile: int) -> PastTiles:
    """Schedule for the selected earlier blocks. past_start [B, S, Hq, K'] (-1 = unused)."""
    b, s, hq, kp = past_start.shape
    c = block_size
    sel = past_start.reshape(-1)  # pairs in (b, t, h, i) order
    npairs = sel.shape[0]
    ar = jnp.arange(npairs, dtype=jnp.int32)
    pb, pt, ph = ar // (s * hq * kp), (ar // (hq * kp)) % s, (ar // kp) % hq
    valid = sel >= 0
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(valid, (pb * hq + ph) * s + sel, big)

    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    skey = key[order]
    svalid = skey != big
    new_group = svalid & jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
    gid = jnp.cumsum(new_group) - 1
    rank = ar - jax.lax.cummax(jnp.where(new_group, ar, 0))
    max_groups = max(b * hq * (s // c), 1)
    gsize = jax.ops.segment_sum(svalid.astype(jnp.int32), jnp.where(svalid, gid, max_groups), max_groups + 1)[
        :-1
    ]
    gtiles = -(-gsize // q_tile)
    goffset = jnp.cumsum(gtiles) - gtiles
    ntiles = -(-npairs // q_tile) + max_groups
    tile = jnp.where(svalid, goffset[jnp.clip(gid, 0, max_groups - 1)] + rank // q_tile, ntiles)
    slot = rank % q_tile

    pair_of = jnp.full((ntiles + 1, q_tile), -1, jnp.int32).at[tile, slot].set(order)[:-1]  # [T, Qt]
    first = jnp.maximum(jnp.max(pair_of, axis=1), 0)  # any real pair of a tile names its block
    start = jnp.maximum(sel[first], 0)
    rows = jnp.where(pair_of >= 0, ((pb * s + pt) * hq + ph)[jnp.maximum(pair_of, 0)], -1)
    lo = jnp.where(pair_of >= 0, start[:, None], 1)
    hi = jnp.where(pair_of >= 0, start[:, None] + c - 1, 0)
    kv_row = pb[first] * num_kv_heads + ph[first] // (hq // num_kv_heads)

    inv = jnp.zeros((npairs,), jnp.int32).at[order].set(ar)
    pair_tile, pair_slot = jnp.clip(tile[inv], 0, ntiles - 1), slot[inv]
    return PastTiles(Tiles(rows, kv_row, start, lo, hi), pair_tile, pair_slot, valid)


def own_tiles(own_start: jax.Array, *, num_q_heads: int, num_kv_heads: int, q_tile: int) -> Tiles:
    """Schedule for the own block: tiles of q_tile consecutive queries of one head. own_start [B, S]."""
    b, s = own_start.shape
    hq = num_q_heads
    n = -(-s // q_tile)
    t = jnp.arange(n * q_tile, dtype=jnp.int32).reshape(n, q_tile)  # [n, Qt] query positions
    real = t < s
    own = jnp.where(real[None], own_start[:, jnp.minimum(t, s - 1)], 1)  # [B, n, Qt]
    hi = jnp.where(real[None], t[None], 0)
    bb, hh = jnp.meshgrid(jnp.arange(b, dtype=jnp.int32), jnp.arange(hq, dtype=jnp.int32), indexing="ij")
    rows = jnp.where(
        real[None, None], (bb[:, :, None, None] * s + t[None, None]) * hq + hh[:, :, None, None], -1
    )
    shape = (b * hq * n, q_tile)
    lo = jnp.broadcast_to(own[:, None], (b, hq, n, q_tile)).reshape(shape)
    hi = jnp.broadcast_to(hi[:, None], (b, hq, n, q_tile)).reshape(shape)
    key_start = jnp.min(jnp.where(hi >= lo, lo, jnp.iinfo(jnp.int32).max), axis=1)
    key_start = jnp.where(key_start == jnp.iinfo(jnp.int32).max, 0, key_start)
    kv_row = jnp.broadcast_to(
        (bb * num_kv_heads + hh // (hq // num_kv_heads))[:, :, None], (b, hq, n)
    ).reshape(-1)
    return Tiles(rows.reshape(shape), kv_row, key_start, lo, hi)
