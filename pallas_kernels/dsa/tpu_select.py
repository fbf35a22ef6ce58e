"""DSA's selection on TPU (Pallas -> Mosaic): the lightning indexer's scores and each query's top-k
in one kernel, the [T, S] scores never in HBM (docs/dsa.md; `effattn_jax.ops.dsa.dsa_select` is the
XLA selection it equals).

The grid is (batch row, tile of QT queries, tile of KT keys). A step scores its key tile for the
tile's queries, I = sum_h w[h] ReLU(q[h] . k), on the MXU (the queries' heads are the rows of one
[Hi * QT, Di] block, head-major), masks it to the causal keys of each query's document and keeps
it in a VMEM row [QT, S] that lasts across the key tiles (key tiles past the query tile copy and
compute nothing). The last step selects from that row, exactly:
- the k-th largest score per query, by a bitwise search over the scores' order-preserving int32
  keys (32 passes of compare-and-count over VMEM; k = min(top_k, the query's visible keys));
- the keys above it, and the earliest of those equal to it (ties to the earlier key, as
  `lax.top_k`), by an exclusive prefix count of the equal ones (a triangular matmul per 128 keys);
- their indices written in key order: each 128-key tile's picks are packed to the front of the
  lanes by seven roll-and-select steps (each moves the picks with bit b of their shift), then
  each query's packed row is rotated to its running offset and written by two masked stores at
  128-aligned offsets (the offset moves to a scalar through a reduction).
The picks and their scores come out in key order, -1 (and -inf) past them; the wrapper orders them
best first (a sort of the [T, K] picks: O(T * K) memory, as the indices themselves).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NT, tpu_interpret, tpu_vmem_limit
from pallas_kernels.dsa import best_first, query_documents

QT = 8  # queries per grid step (a float32 sublane tile)
KT = 256  # keys per grid step
LANES = 128
INT_MIN = -(2**31)


def _sortable(scores):
    """float32 scores (no NaN; -inf where masked) -> int32 keys in the same order."""
    bits = pltpu.bitcast(scores, jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _count(scores_ref, tiles, holds):
    """Per row [QT, 1], how many of the first `tiles` key tiles' sortable keys `holds` (key -> bool),
    a tile at a time (no [QT, S] temporary)."""

    def tile(c, total):
        keys = _sortable(scores_ref[:, pl.ds(pl.multiple_of(c * KT, KT), KT)])
        return total + jnp.sum(holds(keys).astype(jnp.int32), axis=1, keepdims=True)

    return jax.lax.fori_loop(0, tiles, tile, jnp.zeros((QT, 1), jnp.int32))


def _kth_key(scores_ref, tiles, want):
    """Per row, the largest t with at least `want` keys >= t: the want-th largest key [QT, 1]
    (bitwise, from the top bit of t's unsigned pattern: 32 counting passes)."""

    def bit(i, ans):
        cand = ans | jnp.left_shift(jnp.int32(1), 31 - i)
        count = _count(scores_ref, tiles, lambda keys: keys >= (cand ^ jnp.int32(INT_MIN)))
        return jnp.where(count >= want, cand, ans)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(want.shape, jnp.int32)) ^ jnp.int32(INT_MIN)


def _before(mask, upper):
    """[QT, 128] int32: how many lanes before each one hold `mask` (an exclusive prefix count, one
    matmul with the strictly upper triangle `upper`; exact: sums of at most 128 ones)."""
    return jnp.dot(mask.astype(jnp.float32), upper, preferred_element_type=jnp.float32).astype(jnp.int32)


def _pack(picked, upper, *values):
    """Each of `values` with the picked lanes moved to the front of each row, in order (the rest
    undefined): each pick moves left by the unpicked lanes before it, one bit of that shift a step."""
    lane = jax.lax.broadcasted_iota(jnp.int32, picked.shape, 1)
    shift, live, values = lane - _before(picked, upper), picked, list(values)
    for b in range(7):
        step = 1 << b
        moves = live & (((shift >> b) & 1) == 1)
        incoming = pltpu.roll(moves.astype(jnp.int32), LANES - step, 1) > 0
        values = [jnp.where(incoming, pltpu.roll(v, LANES - step, 1), v) for v in values]
        shift = jnp.where(incoming, pltpu.roll(shift, LANES - step, 1), shift)
        live = incoming | (live & jnp.logical_not(moves))
    return values


def _row_scalar(column, q: int):
    """Row q of a [QT, 1] int32 column as a scalar."""
    return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, column.shape, 0) == q, column, 0))


def _kernel(
    last_ref, q_ref, w_ref, k_ref, qpos_ref, qseg_ref, kseg_ref, out_ref, picked_scores_ref, scores_ref, *,
    heads, top_k,
):  # fmt: skip
    n, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    last = last_ref[n * pl.num_programs(1) + i]  # the last key tile a query of this tile sees

    @pl.when(j == 0)
    def _():
        scores_ref[...] = jnp.full(scores_ref.shape, -jnp.inf, jnp.float32)

    @pl.when(j <= last)
    def _():
        dots = jax.lax.dot_general(q_ref[...], k_ref[...], NT, preferred_element_type=jnp.float32)
        dots = jnp.maximum(dots, 0.0)  # [Hi * QT, KT], head-major rows
        w = w_ref[...]  # [QT, Hi], the scale folded in
        s = functools.reduce(jnp.add, [dots[h * QT : (h + 1) * QT] * w[:, h : h + 1] for h in range(heads)])
        k_pos = j * KT + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        visible = (k_pos <= qpos_ref[...]) & (kseg_ref[...] == qseg_ref[...])
        scores_ref[:, pl.ds(pl.multiple_of(j * KT, KT), KT)] = jnp.where(visible, s, -jnp.inf)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        seen = last + 1  # key tiles with a visible key
        finite = _sortable(jnp.full((1, 1), -jnp.inf, jnp.float32))  # keys above it are visible scores
        want = jnp.minimum(_count(scores_ref, seen, lambda keys: keys > finite), top_k)
        kth = _kth_key(scores_ref, seen, want)
        equal_wanted = want - _count(scores_ref, seen, lambda keys: keys > kth)
        out_ref[...] = jnp.full(out_ref.shape, -1, jnp.int32)
        picked_scores_ref[...] = jnp.full(picked_scores_ref.shape, -jnp.inf, jnp.float32)
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
        upper = (
            jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 0)
            < jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 1)
        ).astype(jnp.float32)

        def tile(c, carry):  # 128 keys: their picks appended to each query's list
            written, equal_seen = carry  # [QT, 1] each
            scores = scores_ref[:, pl.ds(pl.multiple_of(c * LANES, LANES), LANES)]
            k = _sortable(scores)
            equal = k == kth
            picked = (k > kth) | (equal & (_before(equal, upper) + equal_seen < equal_wanted))
            index = c * LANES + jnp.broadcast_to(lane, picked.shape)
            packed = _pack(picked, upper, index, scores)
            count = jnp.sum(picked.astype(jnp.int32), axis=1, keepdims=True)
            for q in range(QT):  # each query's packed picks at its own offset
                off, n = _row_scalar(written, q), _row_scalar(count, q)
                r = off % LANES
                base = pl.multiple_of(off - r, LANES)
                for ref, values in zip((out_ref, picked_scores_ref), packed, strict=True):
                    row = pltpu.roll(values[q : q + 1], r, 1)
                    here = ref.at[pl.ds(q, 1), pl.ds(base, LANES)]
                    pltpu.store(here, row, mask=(lane >= r) & (lane < r + n))
                    after = ref.at[pl.ds(q, 1), pl.ds(base + LANES, LANES)]
                    pltpu.store(after, row, mask=lane < r + n - LANES)
            return written + count, equal_seen + jnp.sum(equal.astype(jnp.int32), axis=1, keepdims=True)

        tiles = jax.lax.div(seen * KT, LANES)
        init = (jnp.zeros((QT, 1), jnp.int32), jnp.zeros((QT, 1), jnp.int32))
        jax.lax.fori_loop(0, tiles, tile, init)


def index_topk_tpu(
    q_idx, k_idx, weights, *, top_k: int, segment_ids=None, scale=None, q_index=None, interpret=False
):  # fmt: skip
    """`dsa_select`'s contract: q_idx [B, T, Hi, Di], k_idx [B, S, Di], weights [B, T, Hi], the
    queries at positions `q_index` [B, T] among the keys (default: T = S, in order) -> indices
    [B, T, K'] int32, K' = min(top_k, S), best first (ties to the earlier key), -1 past a query's
    visible keys. `interpret`: True, or "tpu" for the TPU interpreter."""
    q_idx, k_idx, weights = (jax.lax.stop_gradient(x) for x in (q_idx, k_idx, weights))
    b, t, hi, di = q_idx.shape
    s = k_idx.shape[1]
    kk = min(top_k, s)
    scale = 1.0 / math.sqrt(hi * di) if scale is None else scale
    tp, sp = -(-t // QT) * QT, -(-s // KT) * KT
    kw = -(-kk // LANES) * LANES + LANES  # the list, and a window past its end for the last store
    pad = lambda x, to, value=0: jnp.pad(
        x, [(0, 0), (0, to - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=value
    )
    seg, pos, q_seg = query_documents(segment_ids, q_index, b, t, s)
    pos, q_seg = pad(pos, tp), pad(q_seg, tp, -2)  # padded queries: a document no key is in
    seg = pad(seg, sp, -1)  # padded keys: their own document
    # [B, T'/QT, Hi * QT, Di]: each query tile's heads as rows, head-major
    q_rows = pad(q_idx, tp).reshape(b, tp // QT, QT, hi, di).swapaxes(2, 3).reshape(b, tp // QT, hi * QT, di)
    w = pad(weights.astype(jnp.float32) * scale, tp)
    last_tile = (jnp.max(pos.reshape(b, tp // QT, QT), axis=-1) // KT).reshape(-1)  # [B * T'/QT]
    last = lambda n, i, last_ref: last_ref[n * (tp // QT) + i]
    item = jnp.dtype(q_idx.dtype).itemsize
    blocks = (hi * QT + KT) * di * item + QT * hi * 4 + (2 * QT + KT) * 4 + 2 * QT * kw * 4
    picks, scores = pl.pallas_call(
        functools.partial(_kernel, heads=hi, top_k=kk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, tp // QT, sp // KT),
            in_specs=[
                pl.BlockSpec((None, None, hi * QT, di), lambda n, i, j, _: (n, i, 0, 0)),
                pl.BlockSpec((None, QT, hi), lambda n, i, j, _: (n, i, 0)),
                pl.BlockSpec((None, KT, di), lambda n, i, j, r: (n, jnp.minimum(j, last(n, i, r)), 0)),
                pl.BlockSpec((None, QT, 1), lambda n, i, j, _: (n, i, 0)),
                pl.BlockSpec((None, QT, 1), lambda n, i, j, _: (n, i, 0)),
                pl.BlockSpec((None, 1, KT), lambda n, i, j, r: (n, 0, jnp.minimum(j, last(n, i, r)))),
            ],
            out_specs=[pl.BlockSpec((None, QT, kw), lambda n, i, j, _: (n, i, 0))] * 2,
            scratch_shapes=[pltpu.VMEM((QT, sp), jnp.float32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, tp, kw), jnp.int32),
            jax.ShapeDtypeStruct((b, tp, kw), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=tpu_vmem_limit(blocks, QT * sp * 4, 2 * hi * QT * KT * 4),
        ),
        interpret=tpu_interpret(interpret),
        name="dsa_index_topk_tpu",
    )(
        last_tile,
        q_rows,
        w,
        pad(k_idx.astype(q_idx.dtype), sp),
        pos[:, :, None],
        q_seg[:, :, None],
        seg[:, None, :],
    )
    return best_first(picks[:, :t, :kk], scores[:, :t, :kk])
