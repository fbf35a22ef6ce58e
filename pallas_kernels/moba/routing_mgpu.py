"""MoBA's gate on Hopper (Pallas -> Mosaic GPU): routing_gpu.py's design with the scores from a
warpgroup matmul (wgmma) of a TMA-copied query tile against TMA-copied tiles of block means.

One warpgroup per (query head, tile of 64 queries, batch row) copies its queries [64, D] to
shared memory once, then for each tile of 64 block means its queries can pick (the tables of
routing_common.py) copies the means [64, D], takes the scores [64, 64] in float32 registers
(wgmma, bf16/f16 operands: the products are exact, the sums float32), masks them to the
candidates and merges them into the sorted list of k' (score, start) per query
(routing_common.insert; ties to the earlier block). Block starts are carried as float32 (exact
below 2^24 positions) so every reduction is a float max. Only the picks [B, Hq, k', T] reach
global memory. bf16/f16 q and K only, a head dim that is a multiple of 64 and lengths that are
multiples of 64; anything else takes the Triton kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_toolkit as kit
from pallas_kernels.common import mosaic_gpu_interpret
from pallas_kernels.moba.routing_common import insert, routing_tables, scores_in_full_f32

TILE = 64  # queries per warpgroup and block means per step (a wgmma's rows; 128-byte swizzle of bf16)


def supports(q, key_dtype, seq: int) -> str | None:
    """None when this kernel takes these queries [B, T, Hq, D], keys' dtype and key length, else one
    line saying why not."""
    t, d = q.shape[1], q.shape[3]
    if scores_in_full_f32(q.dtype, key_dtype) or d % 64 or t % TILE or seq >= 2**24:
        return (
            f"the Mosaic GPU routing kernel takes bf16/f16 q and K of one dtype, head dims and query counts "
            f"of multiples of 64 and keys under 2**24; got q {q.dtype}{tuple(q.shape)}, K {key_dtype}"
        )
    return None


def routing_mgpu(q, starts, means, lo, hi, picks: int, *, seq: int, key_dtype, interpret=False):
    """routing_gpu's contract (past_start [B, T, Hq, picks]) for shapes `supports` accepts.
    `interpret`: run in Mosaic GPU's interpreter (CPU)."""
    b, t, hq, d = q.shape
    n, hkv = means.shape[1], means.shape[2]
    group, nq = hq // hkv, t // TILE
    n_pad = -(-n // TILE) * TILE
    starts = jnp.pad(starts.astype(jnp.int32), ((0, 0), (0, n_pad - n)), constant_values=seq)
    means = jnp.pad(jnp.moveaxis(means, 2, 1), ((0, 0), (0, 0), (0, n_pad - n), (0, 0))).astype(q.dtype)
    lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
    first, end = routing_tables(starts, lo, hi, q_tile=TILE, mean_tile=TILE)
    bounds = jnp.stack([first, end], axis=-1)  # [B * nq, 2]
    starts_f = starts.astype(jnp.float32)

    def body(
        bounds_ref, q_ref, lo_ref, hi_ref, starts_ref, means_ref, out_ref, q_smem, m_smem, out_smem, bars
    ):
        h, i, row_b = jax.lax.axis_index("heads"), jax.lax.axis_index("q_seq"), jax.lax.axis_index("batch")
        kv = jax.lax.div(h, jnp.int32(group))
        rows = pl.ds(i * TILE, TILE)
        plgpu.copy_gmem_to_smem(q_ref.at[row_b, rows, h], q_smem, bars.at[0])
        # 64 words from global memory: the plain transfer (jax 0.11.2 has no optimized one for GMEM)
        lo = plgpu.load(lo_ref.at[row_b, rows], layout=kit.ROW, optimized=False).astype(jnp.float32)
        hi = plgpu.load(hi_ref.at[row_b, rows], layout=kit.ROW, optimized=False).astype(jnp.float32)
        lo, hi = (jax.lax.broadcast_in_dim(x, (TILE, TILE), [0]) for x in (lo, hi))
        plgpu.barrier_wait(bars.at[0])

        def step(j, carry):
            best, count = carry
            plgpu.copy_gmem_to_smem(means_ref.at[row_b, kv, pl.ds(j * TILE, TILE)], m_smem, bars.at[1])
            st = plgpu.load(starts_ref.at[row_b, pl.ds(j * TILE, TILE)], layout=kit.COL, optimized=False)
            st = jax.lax.broadcast_in_dim(st, (TILE, TILE), [1])  # [Qt, nb] float32 starts
            plgpu.barrier_wait(bars.at[1])
            s = kit.matmul(q_smem, m_smem.T, (TILE, TILE))
            candidate = (st >= lo) & (st < hi)
            s = jnp.where(candidate, s, -jnp.inf)
            count = count + jnp.where(candidate, 1.0, 0.0).sum(axis=1)
            for _ in range(picks):
                top = s.max(axis=1)
                at = -jnp.where(s == jax.lax.broadcast_in_dim(top, s.shape, [0]), -st, -jnp.inf).max(axis=1)
                best = insert(best, (top, at))
                s = jnp.where(st == jax.lax.broadcast_in_dim(at, s.shape, [0]), -jnp.inf, s)
            return best, count

        init = (
            [(kit.full_rows(TILE, -jnp.inf), kit.full_rows(TILE, float(seq)))] * picks,
            kit.full_rows(TILE, 0.0),
        )
        first, end = bounds_ref[row_b * nq + i, 0], bounds_ref[row_b * nq + i, 1]
        best, count = jax.lax.fori_loop(first, end, step, init)
        for slot, (_, start) in enumerate(best):
            out_smem[slot] = jnp.where(count > slot, start, -1.0).astype(jnp.int32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[row_b, h, :, rows])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, hq, picks, t), jnp.int32),
        scratch_types=[
            kit.swizzled_smem((TILE, d), q.dtype),
            kit.swizzled_smem((TILE, d), q.dtype),
            plgpu.SMEM((picks, TILE), jnp.int32),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(hq, nq, b),
        grid_names=("heads", "q_seq", "batch"),
        kernel_name="moba_routing_mgpu",
        interpret=mosaic_gpu_interpret(interpret),  # no cost_estimate: jax 0.11.2 lacks it
    )(bounds, q, lo, hi, starts_f, means)
    return jnp.moveaxis(out, (1, 2), (2, 3))  # [B, T, Hq, picks]
