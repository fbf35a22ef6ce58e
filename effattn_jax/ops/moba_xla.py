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


def _own_block_part(q, k, v, own_start, key_starts, first, *, block_size, scale, before=None):
    """(m, l, o) of the causal own-block softmax: [B, T, Hq], [B, T, Hq], [B, T, Hq, Dv].

    q, k, v [B, T, ...]: the positions first .. first + T - 1 (`first` a multiple of the block,
    may be traced); own_start [B, T] the queries' own blocks, key_starts [B, T] the keys' block
    starts (absolute positions). `before`: (k, v, block starts) of the c keys before `first`
    (a block that starts in them can hold a query's own block: packed documents), or None when
    no own block starts before its query's chunk (one document per row)."""
    b, s, hq, d = q.shape
    hkv, dv, c = k.shape[2], v.shape[3], block_size
    g = hq // hkv
    pad = -s % c
    n = (s + pad) // c
    padt = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    qc = padt(q).reshape(b, n, c, hkv, g, d)
    kc, vc = padt(k).reshape(b, n, c, hkv, d), padt(v).reshape(b, n, c, hkv, dv)
    bs = padt(key_starts).reshape(b, n, c)
    idx = first + jnp.arange(s + pad).reshape(n, c)
    if before is not None:  # keys: previous chunk ++ this chunk
        k0, v0, bs0 = before
        shift = lambda x, x0: jnp.concatenate([x0[:, None].astype(x.dtype), x[:, :-1]], axis=1)
        kc = jnp.concatenate([shift(kc, k0), kc], axis=2)
        vc = jnp.concatenate([shift(vc, v0), vc], axis=2)
        kbs = jnp.concatenate([shift(bs, bs0), bs], axis=2)
        kidx = jnp.concatenate([idx - c, idx], axis=1)  # below 0 before the first chunk: masked
    else:
        kbs, kidx = bs, idx
    own = padt(own_start).reshape(b, n, c)
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
    """(m, l, o) per (query, head, selected block): [B, T, Hq, K'], ..., [B, T, Hq, K', Dv].
    q [B, T, ...] against k, v [B, S, ...] (T < S: a context shard's queries)."""
    b, s, hq, d = q.shape
    hkv, dv, c, keys = k.shape[2], v.shape[3], block_size, k.shape[1]
    sched = past_tiles(routing.past_start, num_kv_heads=hkv, block_size=c, q_tile=q_tile, key_len=keys)
    t = sched.tiles
    qt = q.reshape(-1, d)[jnp.maximum(t.rows, 0)]  # [T, Qt, D]
    kpos = t.key_start[:, None] + jnp.arange(c)[None]  # [T, C]
    kt = jnp.moveaxis(k, 2, 1).reshape(b * hkv, keys, d)[t.kv_row[:, None], kpos]  # [T, C, D]
    vt = jnp.moveaxis(v, 2, 1).reshape(b * hkv, keys, dv)[t.kv_row[:, None], kpos]
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
    b, s = q.shape[:2]
    before = None
    if segment_ids is not None:  # nothing before the first chunk: its keys are masked
        zeros = lambda x: jnp.zeros((b, block_size, *x.shape[2:]), x.dtype)
        before = (zeros(k), zeros(v), jnp.full((b, block_size), -1, jnp.int32))
    key_starts = block_starts(segment_ids, b, s, block_size)
    own = _own_block_part(
        q, k, v, routing.own_start, key_starts, 0, block_size=block_size, scale=scale, before=before
    )
    return _merge(own, q, k, v, routing, block_size=block_size, scale=scale, q_tile=q_tile)


def moba_xla_local(
    q, k, v, routing: Routing, *, firsts, block_size: int, segment_ids=None, scale: float, q_tile: int
):
    """A context shard's queries: q [B, T, Hq, D], runs of T / len(firsts) positions starting at
    `firsts` (multiples of the block, traced), against the whole sequence's k, v [B, S, ...] and
    segment ids [B, S]; `routing` from `moba_routing(..., q_index=...)` of those positions."""
    b, s = k.shape[:2]
    run = q.shape[1] // len(firsts)
    key_starts = block_starts(segment_ids, b, s, block_size)
    at = lambda x, start, size: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
    parts = []
    for i, first in enumerate(firsts):
        rows = slice(i * run, (i + 1) * run)
        before = None
        if segment_ids is not None:  # clamped to 0 for the first run: masked there (kidx < 0)
            prev = jnp.maximum(first - block_size, 0)
            before = tuple(at(x, prev, block_size) for x in (k, v, key_starts))
        parts.append(
            _own_block_part(
                q[:, rows],
                at(k, first, run),
                at(v, first, run),
                routing.own_start[:, rows],
                at(key_starts, first, run),
                first,
                block_size=block_size,
                scale=scale,
                before=before,
            )  # fmt: skip
        )
    own = tuple(jnp.concatenate(x, axis=1) for x in zip(*parts, strict=True))
    return _merge(own, q, k, v, routing, block_size=block_size, scale=scale, q_tile=q_tile)


def _merge(own, q, k, v, routing, *, block_size, scale, q_tile):
    """The own block's (m, l, o) and the selected blocks' merged by log-sum-exp -> [B, T, Hq, Dv]."""
    m0, l0, o0 = own
    if routing.past_start.shape[-1] == 0:
        return (o0 / l0[..., None]).astype(q.dtype)
    m1, l1, o1 = _past_blocks_part(q, k, v, routing, block_size=block_size, scale=scale, q_tile=q_tile)
    m = jnp.maximum(m0, jnp.max(m1, axis=-1))  # [B, T, Hq]
    m = jax.lax.stop_gradient(m)
    w0, w1 = jnp.exp(m0 - m), jnp.exp(m1 - m[..., None])
    l = l0 * w0 + jnp.sum(l1 * w1, axis=-1)
    o = o0 * w0[..., None] + jnp.sum(o1 * w1[..., None], axis=-2)
    return (o / l[..., None]).astype(q.dtype)
