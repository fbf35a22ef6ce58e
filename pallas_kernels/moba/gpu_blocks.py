"""MoBA's selected earlier blocks on GPU (Pallas -> Triton), the same schedule as
tpu_blocks.py: a tile is up to `past_q_tile` rows of one (batch, KV head, block) group, from
any of the KV head's query heads.

Triton takes arbitrary dynamic offsets, so a program reads exactly the block (no alignment
window), `kv_block` keys at a time: the forward is one program per tile with an online
softmax over the block's sub-blocks; the backward is a dq program per tile (a row's dq is
complete within its one block) and a dK/dV program per (group, sub-block) that loops over the
group's tiles, accumulating in registers, and writes its rows once (flash attention 2's dK/dV
loop, with the group's tiles in place of the key's query blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import NT, triton_params
from pallas_kernels.moba.common import dkv_step, online_softmax_init, online_softmax_step


def window(block_size: int, dtype) -> int:
    return block_size


def window_starts(block_start: jax.Array, block_size: int, seq_len: int, dtype) -> jax.Array:
    """tpu_blocks.window_starts' contract; a GPU program reads exactly the block."""
    return block_start.astype(jnp.int32)


def _fwd_kernel(kv_ref, start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, ck, nsub):
    t = pl.program_id(0)
    kv, start, q = kv_ref[t], start_ref[t], q_ref[...]
    qt, dv = q.shape[0], o_ref.shape[-1]

    def body(j, carry):
        keys = pl.ds(start + j * ck, ck)
        s = jax.lax.dot_general(q, k_ref[kv, keys, :], NT, preferred_element_type=jnp.float32) * scale
        return online_softmax_step(carry, s, v_ref[kv, keys, :])

    m, l, acc = jax.lax.fori_loop(0, nsub, body, online_softmax_init(qt, dv))
    o_ref[...] = acc / l
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(
    kv_ref, start_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, ck, nsub
):
    t = pl.program_id(0)
    kv, start = kv_ref[t], start_ref[t]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(j, dq):
        keys = pl.ds(start + j * ck, ck)
        k = k_ref[kv, keys, :]
        p = jnp.exp(jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale - lse)
        dp = jax.lax.dot_general(do, v_ref[kv, keys, :], NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    dq_ref[...] = jax.lax.fori_loop(0, nsub, body, jnp.zeros(dq_ref.shape, jnp.float32)).astype(dq_ref.dtype)


def _dkv_kernel(
    first_ref,
    count_ref,
    kv_ref,
    start_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    ck,
):
    g, j = pl.program_id(0), pl.program_id(1)
    keys = pl.ds(start_ref[g] + j * ck, ck)
    k, v = k_ref[kv_ref[g], keys, :], v_ref[kv_ref[g], keys, :]

    def body(t, carry):
        q, do = q_ref[t], do_ref[t]
        p = jnp.exp(jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale - lse_ref[t])
        dp = jax.lax.dot_general(do, v, NT, preferred_element_type=jnp.float32)
        return dkv_step(carry, q, do, p, p * (dp - delta_ref[t]), scale)

    first = first_ref[g]
    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(first, first + count_ref[g], body, init)
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def group_tables(tile_group, kv_row, block_start, num_groups: int):
    """The dK/dV programs' tables, [G + 1] each: each group's first tile and tile count, KV row
    and block start (slot G, the padding tiles': no tiles)."""
    ntiles = tile_group.shape[0]
    groups = jnp.arange(num_groups + 1, dtype=jnp.int32)
    first = jnp.searchsorted(tile_group, groups, side="left").astype(jnp.int32)
    count = jnp.searchsorted(tile_group, groups, side="right").astype(jnp.int32) - first
    count = count.at[num_groups].set(0)
    g_kv = kv_row[jnp.minimum(first, ntiles - 1)]
    g_start = block_start[jnp.minimum(first, ntiles - 1)]
    return first, count, g_kv, g_start


def _cost(part: str, q_rows, k, v, block_size: int):
    ntiles, qt, d = q_rows.shape
    dv, item = v.shape[-1], q_rows.dtype.itemsize
    pairs = ntiles * qt * block_size
    flops = {"fwd": 2 * d + 2 * dv, "dq": 4 * d + 2 * dv, "dkv": 4 * d + 4 * dv}[part]
    return pl.CostEstimate(
        flops=int(pairs * flops),
        transcendentals=int(pairs),
        bytes_accessed=int(ntiles * (block_size * (d + dv) * item + qt * (d + dv) * item + qt * 8)),
    )


def block_attention_fwd(
    q_rows,
    k,
    v,
    kv_row,
    block_start,
    tile_group,
    *,
    scale,
    block_size,
    block_sizes,
    num_groups,
    interpret=False,
):
    """Same contract as pallas_kernels.moba.tpu_blocks.block_attention_fwd (here padding tiles
    run like real ones: tile_group and num_groups are not needed; their output is never read)."""
    ntiles, qt, d = q_rows.shape
    ck = block_sizes.kv_block
    whole, dv = pl.no_block_spec, v.shape[-1]
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, ck=ck, nsub=block_size // ck),
        grid=(ntiles,),
        in_specs=[whole, whole, pl.BlockSpec((None, qt, d), lambda t: (t, 0, 0)), whole, whole],
        out_specs=[
            pl.BlockSpec((None, qt, dv), lambda t: (t, 0, 0)),
            pl.BlockSpec((None, qt, 1), lambda t: (t, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((ntiles, qt, dv), jnp.float32),
            jax.ShapeDtypeStruct((ntiles, qt, 1), jnp.float32),
        ],
        compiler_params=triton_params(block_sizes.warps(qt, dv), block_sizes.num_stages),
        interpret=bool(interpret),
        name="moba_block_fwd_gpu",
        cost_estimate=_cost("fwd", q_rows, k, v, block_size),
    )(kv_row, block_start, q_rows, k, v)
    return o, lse.reshape(ntiles, qt)


def block_attention_bwd(
    q_rows,
    k,
    v,
    kv_row,
    block_start,
    tile_group,
    group_first,
    do_rows,
    lse,
    delta,
    *,
    scale,
    block_size,
    block_sizes,
    num_groups,
    interpret=False,
):
    """do_rows [T, Qt, Dv]; lse, delta [T, Qt] (+inf / 0 on padding rows). Returns dq [T, Qt, D]
    in the rows' dtype, and dk [G + 1, C, D], dv [G + 1, C, Dv] per (batch, KV head, block)
    group, rounded once (slot G: padding tiles). Unlike the TPU kernel, which adds into the
    own part's dK/dV in place, the caller adds these windows (windows = blocks)."""
    ntiles, qt, d = q_rows.shape
    ck = block_sizes.kv_block
    whole, dv = pl.no_block_spec, v.shape[-1]
    col = lambda x: x.reshape(ntiles, qt, 1)
    row = lambda w: pl.BlockSpec((None, qt, w), lambda t: (t, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, ck=ck, nsub=block_size // ck),
        grid=(ntiles,),
        in_specs=[whole, whole, row(d), whole, whole, row(dv), row(1), row(1)],
        out_specs=row(d),
        out_shape=jax.ShapeDtypeStruct((ntiles, qt, d), q_rows.dtype),
        compiler_params=triton_params(block_sizes.warps(qt, d), block_sizes.num_stages),
        interpret=bool(interpret),
        name="moba_block_dq_gpu",
        cost_estimate=_cost("dq", q_rows, k, v, block_size),
    )(kv_row, block_start, q_rows, k, v, do_rows, col(lse), col(delta))
    first, count, g_kv, g_start = group_tables(tile_group, kv_row, block_start, num_groups)
    block = lambda w: pl.BlockSpec((None, ck, w), lambda g, j: (g, j, 0))
    dk, dvv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, ck=ck),
        grid=(num_groups + 1, block_size // ck),
        in_specs=[whole] * 10,
        out_specs=[block(d), block(dv)],
        out_shape=[
            jax.ShapeDtypeStruct((num_groups + 1, block_size, d), q_rows.dtype),
            jax.ShapeDtypeStruct((num_groups + 1, block_size, dv), q_rows.dtype),
        ],
        compiler_params=triton_params(block_sizes.warps(ck, d + dv), block_sizes.num_stages),
        interpret=bool(interpret),
        name="moba_block_dkv_gpu",
        cost_estimate=_cost("dkv", q_rows, k, v, block_size),
    )(first, count, g_kv, g_start, q_rows, k, v, do_rows, col(lse), col(delta))
    return dq, dk, dvv
