"""MoBA tile attention on GPU (Pallas -> Triton).

Same algorithm and tables as tpu.py ("tables in, selected blocks out"): one
program per tile reads the tile's KV row and first key sub-block from index
tables in global memory and loops over the sub-blocks with an online softmax;
the backward runs a dq kernel (one program per tile) and a dk/dv kernel (one
program per tile and sub-block), both with the global log-sum-exp.

Lowering: the Triton backend (`compiler_params=pallas.triton.CompilerParams`),
because it takes arbitrary dynamic offsets into K/V and runs on every CUDA GPU
jax supports. jax is moving Pallas GPU to Mosaic GPU; the kernel bodies are
plain loads, dots and reductions over the tables, so porting is a change of
the call site (plgpu.kernel + explicit pipelining), not of the algorithm.
Block sizes must be powers of two here (Triton), at least 16 for tensor cores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.moba.common import NT, TN, tile_cost


def _params(num_warps=4):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=2)


def _load_kv(ref, kv, blk, kv_block):
    return ref[kv, pl.ds(blk * kv_block, kv_block), :]


def _scores(q, k, lo, hi, first, j, *, scale, kv_block):
    s = jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale
    kpos = (first + j) * kv_block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return s, (kpos >= lo) & (kpos <= hi)


def _fwd_kernel(
    kv_row_ref, first_ref, q_ref, k_ref, v_ref, lo_ref, hi_ref, o_ref, lse_ref, *, scale, kv_block, nsub, nkb
):
    t = pl.program_id(0)
    kv, first = kv_row_ref[t], first_ref[t]
    q, lo, hi = q_ref[...], lo_ref[...], hi_ref[...]
    qt, dv = q.shape[0], o_ref.shape[-1]

    def body(j, carry):
        m, l, acc = carry
        blk = jnp.minimum(first + j, nkb - 1)
        s, mask = _scores(
            q, _load_kv(k_ref, kv, blk, kv_block), lo, hi, first, j, scale=scale, kv_block=kv_block
        )
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        v = _load_kv(v_ref, kv, blk, kv_block)
        acc = alpha * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), acc

    init = (
        jnp.full((qt, 1), -jnp.inf, jnp.float32),
        jnp.zeros((qt, 1), jnp.float32),
        jnp.zeros((qt, dv), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, nsub, body, init)
    safe_l = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / safe_l).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(safe_l))


def _probs(q, k, v, lo, hi, do, lse, delta, first, j, *, scale, kv_block):
    s, mask = _scores(q, k, lo, hi, first, j, scale=scale, kv_block=kv_block)
    p = jnp.where(mask, jnp.exp(s - lse), 0.0)
    dp = jax.lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
    return p, p * (dp - delta)


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
    *,
    scale,
    kv_block,
    nsub,
    nkb,
):
    t = pl.program_id(0)
    kv, first = kv_row_ref[t], first_ref[t]
    q, lo, hi, do, lse, delta = (
        q_ref[...],
        lo_ref[...],
        hi_ref[...],
        do_ref[...],
        lse_ref[...],
        delta_ref[...],
    )

    def body(j, dq):
        blk = jnp.minimum(first + j, nkb - 1)
        k = _load_kv(k_ref, kv, blk, kv_block)
        _, ds = _probs(
            q,
            k,
            _load_kv(v_ref, kv, blk, kv_block),
            lo,
            hi,
            do,
            lse,
            delta,
            first,
            j,
            scale=scale,
            kv_block=kv_block,
        )
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    dq_ref[...] = jax.lax.fori_loop(0, nsub, body, jnp.zeros(dq_ref.shape, jnp.float32))


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
    nkb,
):
    t, j = pl.program_id(0), pl.program_id(1)
    kv, first = kv_row_ref[t], first_ref[t]
    blk = jnp.minimum(first + j, nkb - 1)
    q, do = q_ref[...], do_ref[...]
    p, ds = _probs(
        q,
        _load_kv(k_ref, kv, blk, kv_block),
        _load_kv(v_ref, kv, blk, kv_block),
        lo_ref[...],
        hi_ref[...],
        do,
        lse_ref[...],
        delta_ref[...],
        first,
        j,
        scale=scale,
        kv_block=kv_block,
    )
    dk_ref[...] = jax.lax.dot_general(ds.astype(q.dtype), q, TN, preferred_element_type=jnp.float32) * scale
    dv_ref[...] = jax.lax.dot_general(p.astype(do.dtype), do, TN, preferred_element_type=jnp.float32)


def _in_specs(qt, widths, grid_rank):
    """Tables and K/V whole (indexed in-kernel); per-tile rows blocked by the tile id."""
    row = lambda w: pl.BlockSpec(
        (None, qt, w), (lambda t: (t, 0, 0)) if grid_rank == 1 else (lambda t, j: (t, 0, 0))
    )
    whole = pl.no_block_spec
    return [whole, whole, row(widths[0]), whole, whole, row(1), row(1)] + [row(w) for w in widths[1:]]


def tile_attention_fwd(q_tiles, k, v, lo, hi, kv_row, first, *, scale, nsub, block_sizes, interpret=False):
    """Same contract as pallas_kernels.moba.tpu.tile_attention_fwd."""
    ntiles, qt, d = q_tiles.shape
    ck, dv, nkb = block_sizes.kv_block, v.shape[-1], k.shape[1] // block_sizes.kv_block
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, kv_block=ck, nsub=nsub, nkb=nkb),
        grid=(ntiles,),
        in_specs=_in_specs(qt, [d], 1),
        out_specs=[
            pl.BlockSpec((None, qt, dv), lambda t: (t, 0, 0)),
            pl.BlockSpec((None, qt, 1), lambda t: (t, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((ntiles, qt, dv), jnp.float32),
            jax.ShapeDtypeStruct((ntiles, qt, 1), jnp.float32),
        ],
        compiler_params=_params(),
        interpret=bool(interpret),
        name="moba_tile_fwd_gpu",
        cost_estimate=tile_cost("fwd", q_tiles, k, v, nsub, ck),
    )(kv_row, first, q_tiles, k, v, lo, hi)


def tile_attention_bwd(
    q_tiles, k, v, lo, hi, kv_row, first, do_tiles, lse, delta, *, scale, nsub, block_sizes, interpret=False
):
    """Same contract as pallas_kernels.moba.tpu.tile_attention_bwd."""
    ntiles, qt, d = q_tiles.shape
    ck, dv, nkb = block_sizes.kv_block, v.shape[-1], k.shape[1] // block_sizes.kv_block
    args = (kv_row, first, q_tiles, k, v, lo, hi, do_tiles, lse, delta)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, kv_block=ck, nsub=nsub, nkb=nkb),
        grid=(ntiles,),
        in_specs=_in_specs(qt, [d, dv, 1, 1], 1),
        out_specs=pl.BlockSpec((None, qt, d), lambda t: (t, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((ntiles, qt, d), jnp.float32),
        compiler_params=_params(),
        interpret=bool(interpret),
        name="moba_tile_dq_gpu",
        cost_estimate=tile_cost("dq", q_tiles, k, v, nsub, ck),
    )(*args)
    dk, dvv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, kv_block=ck, nkb=nkb),
        grid=(ntiles, nsub),
        in_specs=_in_specs(qt, [d, dv, 1, 1], 2),
        out_specs=[
            pl.BlockSpec((None, None, ck, d), lambda t, j: (t, j, 0, 0)),
            pl.BlockSpec((None, None, ck, dv), lambda t, j: (t, j, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((ntiles, nsub, ck, d), jnp.float32),
            jax.ShapeDtypeStruct((ntiles, nsub, ck, dv), jnp.float32),
        ],
        compiler_params=_params(),
        interpret=bool(interpret),
        name="moba_tile_dkv_gpu",
        cost_estimate=tile_cost("dkv", q_tiles, k, v, nsub, ck),
    )(*args)
    return dq, dk, dvv
