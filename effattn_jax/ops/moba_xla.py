"""Sub-quadratic, exact, differentiable MoBA in plain XLA (the CPU path).

Two parts, merged per query by log-sum-exp (docs/moba.md, item 6):

* Own block: blocked local attention. The sequence is cut into chunks of
  `block_size`; each query chunk attends to its own and the previous key chunk
  (the own block always lies inside those 2 * block_size keys), masked to
  "same block, not in the future". Without segment ids blocks are the chunks,
  so the previous chunk is skipped. A chunk's rows run in `own_row_parts` parts,
  part h against only the keys up to its last row, so most of the masked upper
  triangle is never computed ((R + 1) / 2R of the square with R parts).
* Selected earlier blocks: the grouped-matmul trick. The (query, head, block)
  pairs are sorted by block and cut into tiles of q_tile queries sharing one
  K/V block (`pallas_kernels.moba.schedule.past_tiles`, the same schedule
  the Pallas kernels run), and one batched einsum runs every tile.

Cost: S * (top_k - 1) * block_size * D for the past part plus about
S * block_size * D / 2 (+ S * block_size * D with segment ids) for the own part;
no [S, S] array.
K/V are gathered per tile from the KV head of the tile (GQA without copying
K/V to every query head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.routing import Routing
from effattn_jax.ops.segments import block_starts
from pallas_kernels.moba.schedule import past_tiles


def own_row_parts(block_size: int) -> int:
    """Row parts of an own-block chunk: up to 8, each of at least 4 rows."""
    parts = 8
    while parts > 1 and (block_size % parts or block_size // parts < 4):
        parts //= 2
    return parts


def _own_block_part(q, k, v, routing: Routing, *, block_size, segment_ids, scale):
    """(m, l, o) of the causal own-block softmax: [B, S, Hq], [B, S, Hq], [B, S, Hq, Dv]."""
    b, s, hq, d = q.shape
    hkv, dv, c = k.shape[2], v.shape[3], block_size
    g = hq // hkv
    pad = -s % c
    n = (s + pad) // c
    padt = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    qc = padt(q).reshape(b, n, c, hkv, g, d)
    kc, vc = padt(k).reshape(b, n, c, hkv, d), padt(v).reshape(b, n, c, hkv, dv)
    bs = padt(block_starts(segment_ids, b, s, c)).reshape(b, n, c)
    idx = jnp.arange(s + pad).reshape(n, c)
    with_prev = segment_ids is not None
    if with_prev:  # keys: previous chunk ++ this chunk
        shift = lambda x, fill: jnp.concatenate([jnp.full_like(x[:, :1], fill), x[:, :-1]], axis=1)
        kc = jnp.concatenate([shift(kc, 0), kc], axis=2)
        vc = jnp.concatenate([shift(vc, 0), vc], axis=2)
        kbs = jnp.concatenate([shift(bs, -1), bs], axis=2)
        kidx = jnp.concatenate([jnp.concatenate([jnp.full((1, c), -1), idx[:-1]]), idx], axis=1)
    else:
        kbs, kidx = bs, idx
    own = padt(routing.own_start).reshape(b, n, c)
    mask = (kbs[:, :, None, :] == own[:, :, :, None]) & (kidx[None, :, None, :] <= idx[None, :, :, None])
    mask &= (kidx >= 0)[None, :, None, :]
    parts = own_row_parts(c)
    cr, prev = c // parts, kc.shape[2] - c  # the previous chunk's keys come first
    m, l, o = [], [], []
    for h in range(parts):  # rows of part h see none of the chunk's keys after its last row
        rows, keys = slice(h * cr, (h + 1) * cr), slice(0, prev + (h + 1) * cr)
        logits = jnp.einsum(
            "bnqkgd,bnckd->bnkgqc", qc[:, :, rows], kc[:, :, keys], preferred_element_type=jnp.float32
        )
        logits = jnp.where(mask[:, :, None, None, rows, keys], logits * scale, -jnp.inf)
        m_h = jnp.max(logits, axis=-1)  # every real query sees itself, so m is finite there
        m_h = jnp.where(jnp.isfinite(m_h), m_h, 0.0)
        p = jnp.exp(logits - m_h[..., None])
        m.append(m_h)
        l.append(jnp.sum(p, axis=-1))
        o.append(jnp.einsum("bnkgqc,bnckd->bnqkgd", p, vc[:, :, keys].astype(jnp.float32)))
    m, l, o = jnp.concatenate(m, axis=-1), jnp.concatenate(l, axis=-1), jnp.concatenate(o, axis=2)
    m = jnp.moveaxis(m, -1, 2).reshape(b, s + pad, hq)[:, :s]  # [B, n, Hkv, G, C] -> [B, S, Hq]
    l = jnp.moveaxis(l, -1, 2).reshape(b, s + pad, hq)[:, :s]
    o = o.reshape(b, s + pad, hq, dv)[:, :s]
    return m, l, o


def _past_blocks_part(q, k, v, routing: Routing, *, block_size, scale, q_tile):
    """(m, l, o) per (query, head, selected block): [B, S, Hq, K'], ..., [B, S, Hq, K', Dv]."""
    b, s, hq, d = q.shape
    hkv, dv, c = k.shape[2], v.shape[3], block_size
    sched = past_tiles(routing.past_start, num_kv_heads=hkv, block_size=c, q_tile=q_tile)
    t = sched.tiles
    qt = q.reshape(-1, d)[jnp.maximum(t.rows, 0)]  # [T, Qt, D]
    kpos = t.key_start[:, None] + jnp.arange(c)[None]  # [T, C]
    kt = jnp.moveaxis(k, 2, 1).reshape(b * hkv, s, d)[t.kv_row[:, None], kpos]  # [T, C, D]
    vt = jnp.moveaxis(v, 2, 1).reshape(b * hkv, s, dv)[t.kv_row[:, None], kpos]
    logits = jnp.einsum("tqd,tcd->tqc", qt, kt, preferred_element_type=jnp.float32) * scale
    m = jnp.max(logits, axis=-1)
    p = jnp.exp(logits - m[..., None])
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("tqc,tcd->tqd", p, vt.astype(jnp.float32))
    # Back to pair order; unused selections contribute nothing.
    valid, rows = sched.valid, sched.pair_row  # [K', B*S*Hq]
    per_query = lambda x: jnp.moveaxis(x, 0, -1).reshape(b, s, hq, -1)  # [K', B*S*Hq] -> [B, S, Hq, K']
    m_p = per_query(jnp.where(valid, m.reshape(-1)[rows], -jnp.inf))
    l_p = per_query(jnp.where(valid, l.reshape(-1)[rows], 0.0))
    o_p = jnp.where(valid[..., None], o.reshape(-1, dv)[rows], 0.0)  # [K', B*S*Hq, Dv]
    return m_p, l_p, jnp.moveaxis(o_p, 0, 1).reshape(b, s, hq, -1, dv)


def moba_xla(q, k, v, routing: Routing, *, block_size: int, segment_ids=None, scale: float, q_tile: int):
    m0, l0, o0 = _own_block_part(
        q, k, v, routing, block_size=block_size, segment_ids=segment_ids, scale=scale
    )
    if routing.past_start.shape[-1] == 0:
        return (o0 / l0[..., None]).astype(q.dtype)
    m1, l1, o1 = _past_blocks_part(q, k, v, routing, block_size=block_size, scale=scale, q_tile=q_tile)
    m = jnp.maximum(m0, jnp.max(m1, axis=-1))  # [B, S, Hq]
    m = jax.lax.stop_gradient(m)
    w0, w1 = jnp.exp(m0 - m), jnp.exp(m1 - m[..., None])
    l = l0 * w0 + jnp.sum(l1 * w1, axis=-1)
    o = o0 * w0[..., None] + jnp.sum(o1 * w1[..., None], axis=-2)
    return (o / l[..., None]).astype(q.dtype)
