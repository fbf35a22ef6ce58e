"""MoBA's own block on TPU (Pallas -> Mosaic): the sequence in chunks of `block_size` queries,
each against its own chunk of keys (causal, masked to the query's own block) and, only where
a query's own block started in the previous chunk (packed documents), that chunk's keys too.

Without packed documents the blocks are the chunks: a block-diagonal causal kernel, each
key read once per KV head. The grid is (batch x KV head, chunk, query head of the group),
the chunks last to first: the query heads sharing a KV head (GQA) run back to back on the
same K/V blocks, so Pallas copies them once, and dK/dV accumulate across them in a float32
VMEM scratch (stored once per chunk, in the input dtype). The previous chunk's K/V block index
only moves where a chunk needs it, so it is copied only then; the backward accumulates that
chunk's dK/dV in another scratch and starts the previous chunk's accumulator from it (hence
the order), so every key's own-part gradient is written once, complete. Inside a step the
chunk is walked in square tiles (`own_tile`: half the chunk, at most `key_tile`): row tile a
reads key tiles 0..a with an online softmax, so a large MoBA block (4,096 at 1M tokens) needs
no more VMEM than the K/V chunks and the accumulators. q, K, V, dO come head-major
[B*H, S_pad, D] or as they lie, [B, S, H*D] (`heads`). Scores are [keys, rows], so lse and
delta are lane-dense rows, and the forward's o comes out [Dv, rows]: the kernel transposes it
(one [Dv, t] float32 tile per row tile) and writes rows laid out like q. XLA
then needs no transpose of o, whose [Dv, S] layout made the merge of the parts copy every other
part to it, in float32 (BENCHMARKS.md, "History").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NT, TN, tpu_interpret, tpu_vmem_limit
from pallas_kernels.moba.tpu_smem import check_own


def own_tables(own_start: jax.Array, *, block_size: int, seq_pad: int):
    """own [B, 1, S_pad] (a padding row's own block starts at itself); needs [B * n]: the chunk
    has a query whose own block started in the previous chunk; prev [B * n]: the K/V chunk the
    previous-chunk input reads (j - 1 where needed, else the one the step before read, chunks
    running last to first: no copy)."""
    b, s = own_start.shape
    c, n = block_size, -(-s // block_size)
    pos = jnp.arange(seq_pad, dtype=jnp.int32)[None]
    own = jnp.where(pos < s, jnp.pad(own_start, ((0, 0), (0, seq_pad - s))), pos).astype(jnp.int32)
    needs = own[:, : n * c].reshape(b, n, c).min(-1) < jnp.arange(n)[None] * c  # [B, n]
    wanted = jnp.where(needs, jnp.arange(n)[None] - 1, n)  # n: not needed
    carried = jax.lax.cummin(wanted[:, ::-1], axis=1)[:, ::-1]  # the last needed in visiting order
    first = jnp.max(jnp.where(needs, wanted, 0), axis=1, keepdims=True)  # before any: the first needed
    prev = jnp.where(carried == n, first, carried)
    return own[:, None], needs.astype(jnp.int32).reshape(-1), prev.astype(jnp.int32).reshape(-1)


def own_tile(c: int, most: int) -> int:
    """Rows and keys of one inner step for chunks of c: half the chunk (row tile a reads key
    tiles 0..a only, so the chunk's fully masked corner is never issued) or, for a chunk above
    2 * most, the largest divisor of c up to `most` (whole 128-lane tiles where c has them).
    The step's [keys, rows] float32 scores are then at most most² (1 MiB at 512): a chunk of
    4,096 in one step needed 83 MiB of VMEM (BENCHMARKS.md, "Context parallelism")."""
    if c % 2:
        return c
    if c // 2 <= most:
        return c // 2
    unit = 128 if c % 128 == 0 and most >= 128 else 1
    return max(t for t in range(unit, most + 1, unit) if c % t == 0)


def _tile_keys(b, tile: int):
    return pl.ds(pl.multiple_of(b * tile, tile), tile)


def _visible(first_key, b, tile: int, own, rows):
    """Mask [keys, rows] of key tile b (of a chunk starting at first_key) for rows at positions
    `rows` [1, t] whose own blocks start at `own` [1, t]: the own block, causal."""
    keys = first_key + b * tile + jax.lax.broadcasted_iota(jnp.int32, (tile, rows.shape[1]), 0)
    return (keys >= own) & (keys <= rows)


def _fold(carry, s, v):
    """One key tile of the forward, transposed: scores s [keys, rows] (-inf where masked) and
    values v [keys, Dv] folded into (m, l [1, rows], acc [Dv, rows]). A row may have seen no
    key yet (its own block starts later): m stays -inf, and m_safe keeps exp() finite."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=0, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p, alpha = jnp.exp(s - m_safe), jnp.exp(m - m_safe)
    acc = alpha * acc + jax.lax.dot_general(v, p.astype(v.dtype), TN, preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=0, keepdims=True), acc


def _fwd_kernel(
    needs_ref,
    prev_ref,
    q_ref,
    kc_ref,
    vc_ref,
    kp_ref,
    vp_ref,
    own_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    hkv,
    n,
    tile,
):
    r, j = pl.program_id(0), n - 1 - pl.program_id(1)
    c, dv = q_ref.shape[0], vc_ref.shape[-1]
    need = needs_ref[jax.lax.div(r, hkv) * n + j] == 1
    for a in range(c // tile):  # row tiles; each walks its key tiles with an online softmax
        rs = pl.ds(a * tile, tile)
        q, own = q_ref[rs, :], own_ref[:, rs]  # [t, D], [1, t]
        rows = j * c + a * tile + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)

        def step(b, carry, k_ref, v_ref, first_key, q=q, own=own, rows=rows):
            ks = _tile_keys(b, tile)
            s = jax.lax.dot_general(k_ref[ks, :], q, NT, preferred_element_type=jnp.float32) * scale
            s = jnp.where(_visible(first_key, b, tile, own, rows), s, -jnp.inf)
            return _fold(carry, s, v_ref[ks, :])

        def write(carry, rs=rs):
            m, l, acc = carry  # every row sees itself: l > 0
            o_ref[rs, :], lse_ref[:, rs] = (acc / l).T, m + jnp.log(l)

        start = (jnp.full((1, tile), -jnp.inf), jnp.zeros((1, tile)), jnp.zeros((dv, tile)))
        own_part = jax.lax.fori_loop(0, a + 1, lambda b, cr: step(b, cr, kc_ref, vc_ref, j * c), start)
        write(own_part)

        @pl.when(need)
        def _previous_chunk(own_part=own_part, step=step, write=write):
            prev = lambda b, cr: step(b, cr, kp_ref, vp_ref, j * c - c)
            write(jax.lax.fori_loop(0, c // tile, prev, own_part))


def _bwd_kernel(
    needs_ref,
    prev_ref,
    q_ref,
    kc_ref,
    vc_ref,
    kp_ref,
    vp_ref,
    own_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    dkc_ref,
    dvc_ref,
    dq_acc,
    dkc_acc,
    dvc_acc,
    dkp_acc,
    dvp_acc,
    *,
    scale,
    hkv,
    n,
    groups,
    tile,
):
    """The outputs are written once, in their dtype, from float32 VMEM accumulators: dq_acc per
    step; dkc_acc, dvc_acc (this chunk's keys) across the group's query heads; dkp_acc, dvp_acc
    (the previous chunk's keys, from this chunk's queries) until that chunk's turn."""
    r, step, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j = n - 1 - step
    c = q_ref.shape[0]
    row = jax.lax.div(r, hkv) * n
    need = needs_ref[row + j] == 1
    received = (step > 0) & (needs_ref[row + jnp.minimum(j + 1, n - 1)] == 1)

    @pl.when(g == 0)  # the group's first query head: this chunk's dK/dV start from what chunk j + 1
    def _start():  # left for them, or zero
        dkc_acc[...] = jnp.where(received, dkp_acc[...], 0.0)
        dvc_acc[...] = jnp.where(received, dvp_acc[...], 0.0)

    @pl.when((g == 0) & need)
    def _zero_previous():
        for ref in (dkp_acc, dvp_acc):
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)
    for a in range(c // tile):  # row tiles; each walks its key tiles
        rs = pl.ds(a * tile, tile)
        q, do, own = q_ref[rs, :], do_ref[rs, :], own_ref[:, rs]
        lse, delta = lse_ref[:, rs], delta_ref[:, rs]
        rows = j * c + a * tile + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)

        def grads(b, k_ref, v_ref, dk_acc, dv_acc, first_key, tile_rows=(q, do, own, lse, delta, rs, rows)):
            """Key tile b's part of dq, dK, dV, from p and dS [keys, rows] (the global lse)."""
            q, do, own, lse, delta, rs, rows = tile_rows
            ks = _tile_keys(b, tile)
            k, v = k_ref[ks, :], v_ref[ks, :]
            s = jax.lax.dot_general(k, q, NT, preferred_element_type=jnp.float32) * scale
            p = jnp.where(_visible(first_key, b, tile, own, rows), jnp.exp(s - lse), 0.0)
            dp = jax.lax.dot_general(v, do, NT, preferred_element_type=jnp.float32)
            ds = p * (dp - delta)
            dq_acc[rs, :] += (
                jax.lax.dot_general(ds.astype(k.dtype), k, TN, preferred_element_type=jnp.float32) * scale
            )
            dk_acc[ks, :] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32) * scale
            dv_acc[ks, :] += jnp.dot(p.astype(do.dtype), do, preferred_element_type=jnp.float32)

        own_keys = lambda b, _, grads=grads: grads(b, kc_ref, vc_ref, dkc_acc, dvc_acc, j * c)
        jax.lax.fori_loop(0, a + 1, own_keys, None)

        @pl.when(need)
        def _previous_chunk(grads=grads):
            prev_keys = lambda b, _: grads(b, kp_ref, vp_ref, dkp_acc, dvp_acc, j * c - c)
            jax.lax.fori_loop(0, c // tile, prev_keys, None)

    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)

    @pl.when(g == groups - 1)  # the group's last query head: this chunk's dK/dV are complete
    def _store():
        dkc_ref[...] = dkc_acc[...].astype(dkc_ref.dtype)
        dvc_ref[...] = dvc_acc[...].astype(dvc_ref.dtype)


def _specs(c, hkv, groups, n, natural):
    """Index maps over the grid (r = b * Hkv + KV head, step i: chunk n - 1 - i, query head g
    of the group). Head-major arrays [B*H, S_pad, D] are blocked by row; natural ones
    [B, S, H*D] by batch and by the head's D lanes."""
    b_of, kvh_of = lambda r: jax.lax.div(r, hkv), lambda r: jax.lax.rem(r, hkv)
    if natural:
        q_at = lambda r, g, chunk: (b_of(r), chunk, kvh_of(r) * groups + g)
        kv_at = lambda r, chunk: (b_of(r), chunk, kvh_of(r))
    else:
        q_at = lambda r, g, chunk: (r * groups + g, chunk, 0)
        kv_at = lambda r, chunk: (r, chunk, 0)
    q_row = lambda w: pl.BlockSpec((None, c, w), lambda r, i, g, *_: q_at(r, g, n - 1 - i))
    kv_cur = lambda w: pl.BlockSpec((None, c, w), lambda r, i, g, *_: kv_at(r, n - 1 - i))
    kv_prev = lambda w: pl.BlockSpec(
        (None, c, w), lambda r, i, g, needs, prev: kv_at(r, prev[b_of(r) * n + n - 1 - i])
    )
    own = pl.BlockSpec((None, 1, c), lambda r, i, g, *_: (b_of(r), 0, n - 1 - i))
    lane_row = pl.BlockSpec((None, 1, c), lambda r, i, g, *_: (r * groups + g, 0, n - 1 - i))
    return q_row, kv_cur, kv_prev, own, lane_row


def cost_estimate(q_heads, k, v, c: int, n: int, need_fraction: float, part: str, tile: int):
    """Issued work: per (chunk, head) the causal tiles of the own chunk (row tile a reads key
    tiles 0..a), plus the whole previous chunk where needed (`need_fraction` of the chunks; 1
    when not known statically)."""
    bh, _, d = q_heads.shape
    dv, item = v.shape[-1], q_heads.dtype.itemsize
    parts = c // tile
    square = (parts + 1) / (2 * parts) + need_fraction  # [C, C] tiles issued per (chunk, head)
    flops = {"fwd": 2 * d + 2 * dv, "bwd": 6 * d + 4 * dv}[part]
    return pl.CostEstimate(
        flops=int(bh * n * c * c * square * flops),
        transcendentals=int(bh * n * c * c * square),
        bytes_accessed=int(bh * n * c * (d + dv) * (item + 4) + 2 * k.shape[0] * n * c * (d + dv) * item),
    )


def _compiler_params(blocks: int, scratch: int, tile: int):
    """The grid runs its rows in parallel, the chunks and query heads in order (the backward's
    dK/dV accumulate across them). Scoped VMEM: the step's blocks (`blocks` bytes) and scratch,
    and room for a dozen [t, t] float32 temporaries (about 26 MiB forward, 40 MiB backward at
    a MoBA block of 4,096)."""
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary", "arbitrary"),
        vmem_limit_bytes=tpu_vmem_limit(blocks, scratch, 12 * tile * tile * 4),
    )


def _dims(q, k, v, own, heads):
    """(B, Hq, Hkv, D, Dv) of head-major inputs [B*H, S_pad, D] (heads None) or natural ones
    [B, S, H*D] (heads = (Hq, Hkv))."""
    b = own.shape[0]
    if heads is None:
        return b, q.shape[0] // b, k.shape[0] // b, q.shape[-1], v.shape[-1]
    hq, hkv = heads
    return b, hq, hkv, q.shape[-1] // hq, v.shape[-1] // hkv


def _cost(q, v, b, hq, hkv, d, dv, c, n, part, tile):
    heads = lambda h, w, x: jax.ShapeDtypeStruct((b * h, n * c, w), x.dtype)
    return cost_estimate(heads(hq, d, q), heads(hkv, d, q), heads(hkv, dv, v), c, n, 1.0, part, tile)


def own_attention_fwd(q, k, v, own, needs, prev, *, scale, block_size, key_tile, heads=None, interpret=False):
    """q [B*Hq, S_pad, D], k/v [B*Hkv, S_pad, D|Dv] (head-major), or with heads = (Hq, Hkv) the
    natural q [B, S, Hq*D], k/v [B, S, Hkv*D|Dv] (S a multiple of C; D, Dv multiples of 128 on
    a TPU); tables from `own_tables`; each step's tiles `own_tile(block_size, key_tile)`.
    Returns o laid out like q, [B*Hq, S_pad, Dv] or [B, S, Hq*Dv], and lse [B*Hq, 1, n*C],
    float32."""
    b, hq, hkv, d, dv = _dims(q, k, v, own, heads)
    c, n, groups = block_size, needs.shape[0] // b, hq // hkv
    check_own("moba_own_fwd", needs.shape[0])  # needs, prev: scalar-prefetched
    q_row, kv_cur, kv_prev, own_spec, lane_row = _specs(c, hkv, groups, n, heads is not None)
    tile = own_tile(c, key_tile)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, hkv=hkv, n=n, tile=tile),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b * hkv, n, groups),
            in_specs=[q_row(d), kv_cur(d), kv_cur(dv), kv_prev(d), kv_prev(dv), own_spec],
            out_specs=[q_row(dv), lane_row],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((*q.shape[:-1], q.shape[-1] // d * dv), jnp.float32),
            jax.ShapeDtypeStruct((b * hq, 1, n * c), jnp.float32),
        ],
        # blocks: q, this and the previous chunk's K/V, o (float32), own and lse
        compiler_params=_compiler_params(c * ((3 * d + 2 * dv) * q.dtype.itemsize + dv * 4 + 8), 0, tile),
        interpret=tpu_interpret(interpret),
        name="moba_own_fwd",
        cost_estimate=_cost(q, v, b, hq, hkv, d, dv, c, n, "fwd", tile),
    )(needs, prev, q, k, v, k, v, own)


def own_attention_bwd(
    q, k, v, own, needs, prev, do, lse, delta, *, scale, block_size, key_tile, heads=None, interpret=False
):
    """do laid out like q; lse, delta [B*Hq, 1, S_pad] (+inf / 0 on padding rows). Returns dq
    and the keys' dK/dV (from the queries of their own chunk and, where it needs them, of the
    next) laid out like q, k, v over n*C positions, in their dtypes."""
    b, hq, hkv, d, dv = _dims(q, k, v, own, heads)
    c, n, groups = block_size, needs.shape[0] // b, hq // hkv
    check_own("moba_own_bwd", needs.shape[0])
    q_row, kv_cur, kv_prev, own_spec, lane_row = _specs(c, hkv, groups, n, heads is not None)
    grads = lambda x: jax.ShapeDtypeStruct((x.shape[0], n * c, x.shape[-1]), x.dtype)
    acc = lambda w: pltpu.VMEM((c, w), jnp.float32)
    tile = own_tile(c, key_tile)
    return pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, hkv=hkv, n=n, groups=groups, tile=tile),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b * hkv, n, groups),
            in_specs=[
                q_row(d),
                kv_cur(d),
                kv_cur(dv),
                kv_prev(d),
                kv_prev(dv),
                own_spec,
                q_row(dv),
                lane_row,
                lane_row,
            ],
            out_specs=[q_row(d), kv_cur(d), kv_cur(dv)],
            scratch_shapes=[acc(d), acc(d), acc(dv), acc(d), acc(dv)],
        ),
        out_shape=[grads(q), grads(k), grads(v)],
        # dK/dV accumulate over the query heads of a group and carry to the previous chunk:
        # those steps run in order
        # blocks: q, both chunks' K/V, dO, dq, dK, dV, own, lse, delta; scratch: the accumulators
        compiler_params=_compiler_params(
            c * ((5 * d + 4 * dv) * q.dtype.itemsize + 12), c * (3 * d + 2 * dv) * 4, tile
        ),
        interpret=tpu_interpret(interpret),
        name="moba_own_bwd",
        cost_estimate=_cost(q, v, b, hq, hkv, d, dv, c, n, "bwd", tile),
    )(needs, prev, q, k, v, k, v, own, do, lse, delta)
