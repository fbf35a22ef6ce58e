"""MoBA's gate on GPU (Pallas -> Triton): per tile of queries, the scores against the block
means of its document, the masks and a running top-k, all in registers; only the picks
[B, T, Hq, k'] reach memory (the [query, block] scores never do).

The semantics are `effattn_jax.ops.routing.moba_routing`'s, which builds the inputs (block
starts and means, each query's document start and own-block start) and calls this for the
selection: candidates are the full blocks whose start lies in [doc_start, own_start), scored
by the float32 dot of the query with the mean; the k' best, best first, ties to the earlier
block; -1 in the slots past the number of candidates.

One program per (batch row, query head, tile of `q_tile` queries) loops over tiles of
`mean_tile` block means, only those a query of the tile can pick (a table from the starts,
which are in position order), and merges each tile's scores into a sorted list of k'
(score, start) pairs per query: k' rounds of (max, first index of it) over the tile, each
inserted by compare-and-swap. Comparing starts is comparing block indices (starts increase
with the index), so a tie goes to the earlier block as in `top_k_first`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import NT, triton_params
from pallas_kernels.moba.routing_common import insert, routing_tables, scores_in_full_f32

Q_TILE, MEAN_TILE = 64, 64  # queries per program, block means per loop step (powers of two)


def _routing_kernel(
    first_ref,
    end_ref,
    q_ref,
    lo_ref,
    hi_ref,
    starts_ref,
    means_ref,
    out_ref,
    *,
    picks,
    nb,
    group,
    seq,
    full_f32,
):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nq = pl.num_programs(2)
    q = q_ref[...]  # [Qt, D]
    q = q.astype(jnp.float32) if full_f32 else q
    lo, hi = lo_ref[...][:, None], hi_ref[...][:, None]  # [Qt, 1]: document start, own-block start
    qt = q.shape[0]

    def body(j, carry):
        best, count = carry
        means = means_ref[b, h // group, pl.ds(j * nb, nb), :]  # [nb, D]
        means = means.astype(jnp.float32) if full_f32 else means
        precision = jax.lax.Precision.HIGHEST if full_f32 else None
        s = jax.lax.dot_general(q, means, NT, precision=precision, preferred_element_type=jnp.float32)
        starts = starts_ref[b, pl.ds(j * nb, nb)][None, :]  # [1, nb], in position order
        candidate = (starts >= lo) & (starts < hi)  # [Qt, nb]
        s = jnp.where(candidate, s, -jnp.inf)
        count = count + jnp.sum(candidate.astype(jnp.int32), axis=1)
        starts = jnp.broadcast_to(starts, s.shape)
        for _ in range(picks):  # the tile's best, one at a time, into the running list
            top = jnp.max(s, axis=1)
            at = jnp.min(jnp.where(s == top[:, None], starts, seq), axis=1)  # first of equal scores
            best = insert(best, (top, at))
            s = jnp.where(starts == at[:, None], -jnp.inf, s)
        return best, count

    empty = (jnp.full((qt,), -jnp.inf, jnp.float32), jnp.full((qt,), seq, jnp.int32))
    init = ([empty] * picks, jnp.zeros((qt,), jnp.int32))
    row = b * nq + i
    best, count = jax.lax.fori_loop(first_ref[row], end_ref[row], body, init)
    for slot, (_, start) in enumerate(best):
        out_ref[b, h, slot, pl.ds(i * qt, qt)] = jnp.where(count > slot, start, -1)


def routing_gpu(q, starts, means, lo, hi, picks: int, *, seq: int, key_dtype, interpret: bool = False):
    """past_start [B, T, Hq, picks] int32 (moba_routing's Routing.past_start) from q [B, T, Hq, D],
    block starts [B, n] (position order; `seq` = S marks an unused one) and means [B, n, Hkv, D]
    (float32 holding values of `key_dtype`), each query's document start lo and own-block start
    hi [B, T]. bf16/f16 queries and keys score on the tensor cores in that dtype with float32
    sums (exact products, as the float32 dot); anything else in full float32 (no TF32)."""
    b, t, hq, d = q.shape
    n, hkv = means.shape[1], means.shape[2]
    full_f32 = scores_in_full_f32(q.dtype, key_dtype)
    q_tile = min(Q_TILE, max(16, pl.next_power_of_2(t)))
    nb = min(MEAN_TILE, max(16, pl.next_power_of_2(n)))
    tp, n_pad = -(-t // q_tile) * q_tile, -(-n // nb) * nb
    if tp != t:  # only shapes that are not a multiple of the tile (small ones) pay this copy
        q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
        lo, hi = (jnp.pad(x, ((0, 0), (0, tp - t)), mode="edge") for x in (lo, hi))
    starts = jnp.pad(starts.astype(jnp.int32), ((0, 0), (0, n_pad - n)), constant_values=seq)
    means = jnp.pad(jnp.moveaxis(means, 2, 1), ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))  # [B, Hkv, n', D]
    means = means.astype(
        jnp.float32 if full_f32 else q.dtype
    )  # in the keys dtype: the values are q's dtype's
    lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
    first, end = routing_tables(starts, lo, hi, q_tile=q_tile, mean_tile=nb)
    whole = pl.no_block_spec
    rows = pl.BlockSpec((None, q_tile), lambda i, h, j: (i, j))
    out = pl.pallas_call(
        functools.partial(_routing_kernel, picks=picks, nb=nb, group=hq // hkv, seq=seq, full_f32=full_f32),
        grid=(b, hq, tp // q_tile),
        in_specs=[
            whole,
            whole,
            pl.BlockSpec((None, q_tile, None, d), lambda i, h, j: (i, j, h, 0)),
            rows,
            rows,
            whole,
            whole,
        ],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((b, hq, picks, tp), jnp.int32),
        compiler_params=triton_params(),
        interpret=bool(interpret),
        name="moba_routing_gpu",
        cost_estimate=pl.CostEstimate(
            flops=2 * b * hq * tp * n_pad * d,
            transcendentals=0,
            bytes_accessed=q.size * q.dtype.itemsize
            + means.size * means.dtype.itemsize
            + 4 * b * hq * picks * tp,
        ),
    )(first, end, q, lo, hi, starts, means)
    return jnp.moveaxis(out, (1, 2), (2, 3))[:, :t]  # [B, T, Hq, picks]
