"""What MoBA's routing kernels share (GPU and TPU): the running top-k list and the tables that
bound each query tile's loop over the block means. The semantics are `moba_routing`'s
(effattn_jax/ops/routing.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def better(a, b):
    """Whether (score, start) pair a ranks before b: a higher score, or the same and an earlier block
    (starts increase with the block index, so this is `top_k_first`'s tie rule)."""
    return (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))


def insert(best, new):
    """`best`: k' (score, start) pairs of per-query vectors, sorted best first; `new` put in its
    place by compare-and-swap (the last one drops out)."""
    out = []
    for entry in best:
        swap = better(new, entry)
        out.append(tuple(jnp.where(swap, x, y) for x, y in zip(new, entry, strict=True)))
        new = tuple(jnp.where(swap, y, x) for x, y in zip(new, entry, strict=True))
    return out


def routing_tables(starts, lo, hi, *, q_tile: int, mean_tile: int):
    """first, end [B * T / q_tile]: the tiles of block means a tile of queries can pick from,
    those with a start in [min doc_start, max own_start) of its queries (starts [B, n] are in
    position order)."""
    b = lo.shape[0]
    tile_lo, tile_hi = lo.reshape(b, -1, q_tile).min(-1), hi.reshape(b, -1, q_tile).max(-1)
    search = jax.vmap(lambda row, x: jnp.searchsorted(row, x, side="left"))
    first = search(starts, tile_lo) // mean_tile
    end = -(-search(starts, tile_hi) // mean_tile)
    return first.astype(jnp.int32).reshape(-1), jnp.maximum(end, first).astype(jnp.int32).reshape(-1)


def scores_in_full_f32(q_dtype, key_dtype) -> bool:
    """Whether the scores take a full-float32 dot: unless q and K share a 16-bit float dtype, whose
    products are exact in float32 (the means hold values of K's dtype), so the dot can take them in
    that dtype with float32 sums, as the float32 dot of `moba_routing` computes them."""
    return not (q_dtype == key_dtype and q_dtype in (jnp.bfloat16, jnp.float16))
