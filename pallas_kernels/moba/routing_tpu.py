"""MoBA's gate on TPU (Pallas -> Mosaic): the GPU kernel's design (routing_gpu.py) with the
scores transposed, [means, queries], so each query's running top-k is a lane-dense vector.

One grid step per (batch row, query head, tile of 128 queries) holds the KV head's block means
of the row in VMEM (fetched once per head: the index does not change along the tiles) and
loops over `MEAN_TILE` of them at a time, only those a query of the tile can pick (scalar-
prefetched tables from the block starts): the scores [means, queries] from one MXU dot,
the candidate mask (start in [document start, own-block start)), then k' rounds of (max, first
start of it) down the sublanes, each put into the sorted list of k' (score, start) [1, Qt]
vectors by compare-and-swap (routing_common.insert; ties to the earlier block). Only the
picks [B, Hq, k', T] reach HBM.

q is read where it lies, a head being D lanes of [B, T, Hq * D], when D is a multiple of 128;
otherwise through a head-major copy [B, Hq, T, D].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import NT, tpu_interpret, tpu_vmem_limit
from pallas_kernels.moba.routing_common import insert, routing_tables, scores_in_full_f32

Q_TILE, MEAN_TILE = 128, 128  # queries per grid step (lanes), block means per loop step


def _routing_kernel(
    first_ref, end_ref, q_ref, lo_ref, hi_ref, starts_ref, means_ref, out_ref, *, picks, nb, seq, full_f32
):
    b, i = pl.program_id(0), pl.program_id(2)
    row = b * pl.num_programs(2) + i
    q = q_ref[...]  # [Qt, D]
    q = q.astype(jnp.float32) if full_f32 else q
    lo, hi = lo_ref[...], hi_ref[...]  # [1, Qt]: document start, own-block start
    qt = q.shape[0]
    precision = jax.lax.Precision.HIGHEST if full_f32 else None

    def body(j, carry):
        values, firsts, count = carry  # [k', Qt], [k', Qt], [1, Qt]: the running list, best first
        best = [(values[m : m + 1], firsts[m : m + 1]) for m in range(picks)]
        at = pl.multiple_of(j * nb, nb)
        means = means_ref[pl.ds(at, nb), :]  # [nb, D]
        means = means.astype(jnp.float32) if full_f32 else means
        s = jax.lax.dot_general(means, q, NT, precision=precision, preferred_element_type=jnp.float32)
        starts = jnp.broadcast_to(starts_ref[pl.ds(at, nb), :], s.shape)  # [nb, Qt], position order
        candidate = (starts >= lo) & (starts < hi)
        s = jnp.where(candidate, s, -jnp.inf)
        count = count + jnp.sum(candidate.astype(jnp.int32), axis=0, keepdims=True)
        for _ in range(picks):  # the tile's best, one at a time, into the running list
            top = jnp.max(s, axis=0, keepdims=True)
            first = jnp.min(jnp.where(s == top, starts, seq), axis=0, keepdims=True)
            best = insert(best, (top, first))
            s = jnp.where(starts == first, -jnp.inf, s)
        stack = lambda i: jnp.concatenate([entry[i] for entry in best], axis=0)
        return stack(0), stack(1), count

    # the list is carried as two arrays: the TPU interpreter mixed up a carry of 2 k' + 1 arrays
    init = (jnp.full((picks, qt), -jnp.inf, jnp.float32), jnp.full((picks, qt), seq, jnp.int32))
    _, firsts, count = jax.lax.fori_loop(
        first_ref[row], end_ref[row], body, init + (jnp.zeros((1, qt), jnp.int32),)
    )
    slot = jax.lax.broadcasted_iota(jnp.int32, firsts.shape, 0)
    out_ref[...] = jnp.where(count > slot, firsts, -1)


def routing_tpu(q, starts, means, lo, hi, picks: int, *, seq: int, key_dtype, interpret=False):
    """past_start [B, T, Hq, picks] int32 (moba_routing's Routing.past_start) from q [B, T, Hq, D],
    block starts [B, n] (position order; `seq` = S marks an unused one) and means [B, n, Hkv, D]
    (float32 holding values of `key_dtype`), each query's document start lo and own-block start
    hi [B, T]. bf16/f16 q and K score on the MXU in that dtype with float32 sums (exact products);
    anything else at full float32 precision. `interpret`: True, or "tpu" for the TPU interpreter."""
    b, t, hq, d = q.shape
    n, hkv = means.shape[1], means.shape[2]
    group = hq // hkv
    full_f32 = scores_in_full_f32(q.dtype, key_dtype)
    tp = -(-t // Q_TILE) * Q_TILE
    nb = min(MEAN_TILE, -(-n // 16) * 16)
    n_pad = -(-n // nb) * nb
    if tp != t:  # only lengths that are not a multiple of the tile (small ones) pay this copy
        q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
        lo, hi = (jnp.pad(x, ((0, 0), (0, tp - t)), mode="edge") for x in (lo, hi))
    starts = jnp.pad(starts.astype(jnp.int32), ((0, 0), (0, n_pad - n)), constant_values=seq)
    means = jnp.pad(jnp.moveaxis(means, 2, 1), ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))  # [B, Hkv, n', D]
    means = means.astype(jnp.float32 if full_f32 else q.dtype)  # in K's dtype: the values are its own
    lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
    first, end = routing_tables(starts, lo, hi, q_tile=Q_TILE, mean_tile=nb)
    if d % 128 == 0:  # a head is D whole lanes of [B, T, Hq * D]: read in place
        q_in = q.reshape(b, tp, hq * d)
        q_spec = pl.BlockSpec((None, Q_TILE, d), lambda i, h, j, *_: (i, j, h))
    else:
        q_in = jnp.moveaxis(q, 2, 1)  # [B, Hq, T, D]
        q_spec = pl.BlockSpec((None, None, Q_TILE, d), lambda i, h, j, *_: (i, h, j, 0))
    rows = pl.BlockSpec((None, 1, Q_TILE), lambda i, h, j, *_: (i, 0, j))
    item = means.dtype.itemsize
    blocks = Q_TILE * d * q.dtype.itemsize + n_pad * d * item + n_pad * 128 * 4 + (2 + picks) * Q_TILE * 4
    out = pl.pallas_call(
        functools.partial(_routing_kernel, picks=picks, nb=nb, seq=seq, full_f32=full_f32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hq, tp // Q_TILE),
            in_specs=[
                q_spec,
                rows,
                rows,
                pl.BlockSpec((None, n_pad, 1), lambda i, h, j, *_: (i, 0, 0)),
                pl.BlockSpec((None, None, n_pad, d), lambda i, h, j, *_: (i, jax.lax.div(h, group), 0, 0)),
            ],
            out_specs=pl.BlockSpec((None, None, picks, Q_TILE), lambda i, h, j, *_: (i, h, 0, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((b, hq, picks, tp), jnp.int32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=tpu_vmem_limit(blocks, 0, 8 * nb * Q_TILE * 4),
        ),
        interpret=tpu_interpret(interpret),
        name="moba_routing_tpu",
        cost_estimate=pl.CostEstimate(
            flops=2 * b * hq * tp * n_pad * d,
            transcendentals=0,
            bytes_accessed=q.size * q.dtype.itemsize + means.size * item + 4 * b * hq * picks * tp,
        ),
    )(first, end, q_in, lo[:, None], hi[:, None], starts[..., None], means)
    return jnp.moveaxis(out, (1, 2), (2, 3))[:, :t]  # [B, T, Hq, picks]
