"""MoBA tile attention on TPU (Pallas -> Mosaic).

Each grid step (tile t, key sub-block j) attends one tile of q_tile query rows to
one aligned `kv_block` of keys; tables prefetched into SMEM (scalar prefetch,
as in jax's paged_attention) pick the KV head row and the first key sub-block
of every tile, so only the selected keys are ever fetched: no dense mask, no
per-block mask in HBM, and K/V stay at the KV-head count (GQA). Each row masks
keys to its own interval [lo, hi] (see common.py). Forward keeps an online
softmax in VMEM scratch across the sub-blocks; the backward is split into a dq
kernel and a dk/dv kernel, both using the global (merged) log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.moba.common import NT, TN, tile_cost


def _scores(q_ref, k_ref, lo_ref, hi_ref, first_ref, *, scale, kv_block):
    t, j = pl.program_id(0), pl.program_id(1)
    qt = q_ref.shape[0]
    s = jax.lax.dot_general(q_ref[...], k_ref[...], NT, preferred_element_type=jnp.float32) * scale
    kpos = (first_ref[t] + j) * kv_block + jax.lax.broadcasted_iota(jnp.int32, (qt, kv_block), 1)
    mask = (kpos >= lo_ref[...]) & (kpos <= hi_ref[...])
    return s, mask


def _fwd_kernel(
    kv_row_ref,
    first_ref,
    q_ref,
    k_ref,
    v_ref,
    lo_ref,
    hi_ref,
    o_ref,
    lse_ref,
    m_sc,
    l_sc,
    acc_sc,
    *,
    scale,
    kv_block,
    nsub,
):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    s, mask = _scores(q_ref, k_ref, lo_ref, hi_ref, first_ref, scale=scale, kv_block=kv_block)
    s = jnp.where(mask, s, -jnp.inf)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[...]
    acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_sc[...] = m_new

    @pl.when(j == nsub - 1)
    def _done():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(l == 0.0, -jnp.inf, m_sc[...] + jnp.log(jnp.where(l == 0.0, 1.0, l)))


def _probs(q_ref, k_ref, v_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref, first_ref, *, scale, kv_block):
    """p and dS = p * (dP - delta) of one (tile, sub-block), from the global LSE."""
    s, mask = _scores(q_ref, k_ref, lo_ref, hi_ref, first_ref, scale=scale, kv_block=kv_block)
    p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
    dp = jax.lax.dot_general(do_ref[...], v_ref[...], NT, preferred_element_type=jnp.float32)
    return p, p * (dp - delta_ref[...])


def _dq_kernel(
    kv_row_ref,
    first_ref,
    q_ref,
    k_ref,
    v_ref,
    lo_ref,
    hi_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    dq_sc,
    *,
    scale,
    kv_block,
    nsub,
):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    _, ds = _probs(
        q_ref,
        k_ref,
        v_ref,
        lo_ref,
        hi_ref,
        do_ref,
        lse_ref,
        delta_ref,
        first_ref,
        scale=scale,
        kv_block=kv_block,
    )
    k = k_ref[...]
    dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    @pl.when(j == nsub - 1)
    def _done():
        dq_ref[...] = dq_sc[...]


def _dkv_kernel(
    kv_row_ref,
    first_ref,
    q_ref,
    k_ref,
    v_ref,
    lo_ref,
    hi_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    kv_block,
):
    p, ds = _probs(
        q_ref,
        k_ref,
        v_ref,
        lo_ref,
        hi_ref,
        do_ref,
        lse_ref,
        delta_ref,
        first_ref,
        scale=scale,
        kv_block=kv_block,
    )
    q, do = q_ref[...], do_ref[...]
    dk_ref[...] = jax.lax.dot_general(ds.astype(q.dtype), q, TN, preferred_element_type=jnp.float32) * scale
    dv_ref[...] = jax.lax.dot_general(p.astype(do.dtype), do, TN, preferred_element_type=jnp.float32)


def _specs(k, v, qt, ck, nkb, extra_row_inputs):
    """BlockSpecs shared by the three kernels: per-tile rows, and the table-driven K/V sub-block."""
    row = lambda width: pl.BlockSpec((None, qt, width), lambda t, j, kv, first: (t, 0, 0))
    kv_spec = lambda width: pl.BlockSpec(
        (None, ck, width), lambda t, j, kv, first: (kv[t], jnp.minimum(first[t] + j, nkb - 1), 0)
    )
    return [row(k.shape[-1]), kv_spec(k.shape[-1]), kv_spec(v.shape[-1]), row(1), row(1)] + [
        row(w) for w in extra_row_inputs
    ]


def _interpret(interpret):
    return pltpu.InterpretParams() if interpret == "tpu" else bool(interpret)


def tile_attention_fwd(q_tiles, k, v, lo, hi, kv_row, first, *, scale, nsub, block_sizes, interpret=False):
    """q_tiles [T, Qt, D]; k/v [B*Hkv, S_pad, D|Dv]; lo/hi [T, Qt, 1]; kv_row, first [T].
    Returns o [T, Qt, Dv] float32 (normalised per tile) and lse [T, Qt, 1] (-inf: row saw nothing)."""
    ntiles, qt, _ = q_tiles.shape
    ck, dv, nkb = block_sizes.kv_block, v.shape[-1], k.shape[1] // block_sizes.kv_block
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(ntiles, nsub),
        in_specs=_specs(k, v, qt, ck, nkb, []),
        out_specs=[
            pl.BlockSpec((None, qt, dv), lambda t, j, *_: (t, 0, 0)),
            pl.BlockSpec((None, qt, 1), lambda t, j, *_: (t, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((qt, 1), jnp.float32),
            pltpu.VMEM((qt, 1), jnp.float32),
            pltpu.VMEM((qt, dv), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, kv_block=ck, nsub=nsub),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((ntiles, qt, dv), jnp.float32),
            jax.ShapeDtypeStruct((ntiles, qt, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name="moba_tile_fwd",
        cost_estimate=tile_cost("fwd", q_tiles, k, v, nsub, ck),
    )(kv_row, first, q_tiles, k, v, lo, hi)


def tile_attention_bwd(
    q_tiles, k, v, lo, hi, kv_row, first, do_tiles, lse, delta, *, scale, nsub, block_sizes, interpret=False
):
    """Returns dq [T, Qt, D] and per (tile, sub-block) dk [T, nsub, Ck, D], dv [T, nsub, Ck, Dv] (float32)."""
    ntiles, qt, d = q_tiles.shape
    ck, dv, nkb = block_sizes.kv_block, v.shape[-1], k.shape[1] // block_sizes.kv_block
    in_specs = _specs(k, v, qt, ck, nkb, [dv, 1, 1])
    args = (kv_row, first, q_tiles, k, v, lo, hi, do_tiles, lse, delta)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, kv_block=ck, nsub=nsub),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(ntiles, nsub),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, qt, d), lambda t, j, *_: (t, 0, 0)),
            scratch_shapes=[pltpu.VMEM((qt, d), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((ntiles, qt, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name="moba_tile_dq",
        cost_estimate=tile_cost("dq", q_tiles, k, v, nsub, ck),
    )(*args)
    dk, dvv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, kv_block=ck),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(ntiles, nsub),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, ck, d), lambda t, j, *_: (t, j, 0, 0)),
                pl.BlockSpec((None, None, ck, dv), lambda t, j, *_: (t, j, 0, 0)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((ntiles, nsub, ck, d), jnp.float32),
            jax.ShapeDtypeStruct((ntiles, nsub, ck, dv), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret(interpret),
        name="moba_tile_dkv",
        cost_estimate=tile_cost("dkv", q_tiles, k, v, nsub, ck),
    )(*args)
    return dq, dk, dvv
